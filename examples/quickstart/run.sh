#!/usr/bin/env bash
# The quickstart: set up the venv (first run only), then train a small model with interleaved
# pipeline parallelism on CPU/gloo and compare it with single-process training.
#   bash examples/quickstart/run.sh                      # pp 2, 2 virtual stages, variable lengths
#   NPROC=4 bash examples/quickstart/run.sh --p2p overlapped
# Extra arguments go to pipeline_demo.py (see --help).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$(bash "$repo_root/tools/ensure_venv.sh")"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$venv/bin/python" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" \
    "$repo_root/examples/quickstart/pipeline_demo.py" "$@"
