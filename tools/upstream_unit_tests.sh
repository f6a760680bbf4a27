#!/usr/bin/env bash
# Run upstream Megatron-LM core_v0.11.0's in-scope unit tests against upstream and against this
# tree, and print per test file what upstream passes that this tree does not:
#
#   tools/upstream_unit_tests.sh UPSTREAM_TREE [--world-size N] [--only PATTERN]... [-- PYTEST_ARGS...]
#
# The scope is tools/upstream_unit_tests_scope.toml; --help lists the other options. Python:
# $PYTHON, else this tree's .venv, else python3. Exit status 0 whatever the tests did, 2 when
# the comparison could not be made. The work is done by tools/upstream_unit_tests.py.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then
        python="$repo_root/.venv/bin/python"
    else
        python="python3"
    fi
fi
exec "$python" "$repo_root/tools/upstream_unit_tests.py" "$@"
