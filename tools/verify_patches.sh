#!/usr/bin/env bash
# Prove the patches in patches/ on upstream megatron-core itself: download the released wheels,
# reproduce issue #1450 on the unpatched code, apply the patches, check the fix and that a
# pipeline of 4 posts the very same p2p operations as before. CPU only, about a minute.
# Arguments go to pytest unchanged (e.g. -s to see the failures observed on unpatched code).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$repo_root/tools/ensure_venv.sh")"

cd "$repo_root"
exec "$venv/bin/python" -m pytest -m upstream tests/upstream/test_patches.py "$@"
