#!/usr/bin/env bash
# Run the test suite in the project's venv; arguments go to pytest unchanged:
#   bash tests/run.sh                  # everything
#   bash tests/run.sh -m "not slow"    # quick subset
# The exit status is pytest's.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$repo_root/tools/ensure_venv.sh")"

cd "$repo_root"
exec "$venv/bin/python" -m pytest "$@"
