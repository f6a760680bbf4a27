#!/usr/bin/env bash
# Make sure the project's virtual environment exists and is up to date, then print its path.
#
#   VENV=/some/dir tools/ensure_venv.sh   # default: <repo>/.venv, created with `python3`
#
# Only the path goes to stdout (callers capture it); pip's chatter goes to stderr.
# Reinstalling is skipped while a stamp in the venv matches the dependency files, so
# calling this before every test run costs almost nothing.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$repo_root/.venv}"
stamp="$venv/.megatron-safepipe-install.sha256"

if [[ ! -x "$venv/bin/python" ]]; then
    echo "ensure_venv: creating $venv with $(command -v python3)" >&2
    python3 -m venv "$venv" >&2
fi

# The editable install points at repo_root, so a moved checkout must reinstall too.
wanted="$(
    {
        echo "$repo_root"
        cat "$repo_root/requirements.txt" "$repo_root/setup.py" "$repo_root/pyproject.toml"
    } | sha256sum | cut -d' ' -f1
)"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$wanted" ]]; then
    # Pinned requirements first: with torch already pinned, installing the package
    # itself cannot make pip pick (and download) another torch build.
    "$venv/bin/python" -m pip install -r "$repo_root/requirements.txt" >&2
    "$venv/bin/python" -m pip install -e "$repo_root" >&2
    echo "$wanted" >"$stamp"
fi

echo "$venv"
