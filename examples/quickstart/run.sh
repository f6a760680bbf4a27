#!/usr/bin/env bash
# The quickstart: set everything up on first use (venv, tiny tokenizer and dataset from the
# bundled corpus), then pretrain a small GPT on CPU with gloo, exactly the pipeline layout upstream
# Megatron-LM gets wrong: pipeline size 2, two virtual stages per rank (interleaved 1F1B),
# variable sequence lengths, batched p2p. The loss falls from ~6.3 to ~0.8 in about three
# minutes on two cores.
#   bash examples/quickstart/run.sh                 # extra arguments go to pretrain_gpt.py
#   NPROC=4 bash examples/quickstart/run.sh --pipeline-model-parallel-size 4
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="$(bash "$repo_root/tools/ensure_venv.sh")"
data="${QUICKSTART_DATA:-$repo_root/examples/quickstart/data/build}"
if [[ ! -f "$data/corpus_text_document.idx" ]]; then
    "$venv/bin/python" "$repo_root/tools/make_quickstart_data.py" "$data"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

MODEL=(--transformer-impl local --num-layers 8 --hidden-size 256 --num-attention-heads 8
       --seq-length 128 --max-position-embeddings 128 --hidden-dropout 0 --attention-dropout 0
       --init-method-std 0.02)
TRAINING=(--micro-batch-size 4 --global-batch-size 32 --train-iters 200 --lr 2e-3 --min-lr 2e-4
          --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1 --clip-grad 1.0
          --adam-beta1 0.9 --adam-beta2 0.95)
PARALLEL=(--distributed-backend gloo --pipeline-model-parallel-size 2
          --num-layers-per-virtual-pipeline-stage 2 --no-overlap-p2p-communication
          --variable-seq-lengths)
DATA=(--data-path "$data/corpus_text_document" --split 949,50,1
      --tokenizer-type Llama2Tokenizer --tokenizer-model "$data/tokenizer.model"
      --data-cache-path "$data/cache" --num-workers 0)
LOGGING=(--log-interval 10 --eval-interval 100 --eval-iters 4)

cd "$repo_root"
exec "$venv/bin/python" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" \
    pretrain_gpt.py "${MODEL[@]}" "${TRAINING[@]}" "${PARALLEL[@]}" "${DATA[@]}" "${LOGGING[@]}" "$@"
