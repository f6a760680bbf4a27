# Shared by train_gpt3_7b_pp4.sh and train_gpt3_7b_pp2_vpp2.sh: the 7B GPT of the upstream
# reports (#1027, #1450) -- 32 layers, hidden 4096, 32 heads, sequence 4096, Transformer Engine,
# fp16 with loss scaling, Adam, cosine decay, gradient clipping, the distributed optimizer.
#
# Positional arguments, as in the reports' scripts:
#   $1 checkpoint directory   $2 TensorBoard directory   $3 data prefix (..._text_document)
#   $4 SentencePiece tokenizer model
# Environment overrides: GPUS_PER_NODE (8), NUM_NODES (1), NODE_RANK (0), MASTER_ADDR
# (localhost), MASTER_PORT (6000); for scaled-down runs NUM_LAYERS (32), TRAIN_ITERS (275),
# GLOBAL_BATCH_SIZE (128), TRANSFORMER_IMPL (transformer_engine). Arguments after the fourth go
# to pretrain_gpt.py unchanged.

set -euo pipefail
if [[ $# -lt 4 ]]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH DATA_PATH TOKENIZER_MODEL [pretrain_gpt.py args...]" >&2
    exit 2
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"

GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NUM_NODES="${NUM_NODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"

CHECKPOINT_PATH="$1"
TENSORBOARD_LOGS_PATH="$2"
DATA_PATH="$3"
TOKENIZER_MODEL_PATH="$4"
shift 4

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

GPT_MODEL_ARGS=(
    --use-mcore-models
    --transformer-impl "${TRANSFORMER_IMPL:-transformer_engine}"
    --num-layers "${NUM_LAYERS:-32}"
    --hidden-size 4096
    --num-attention-heads 32
    --seq-length 4096
    --max-position-embeddings 4096
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size "${GLOBAL_BATCH_SIZE:-128}"
    --train-iters "${TRAIN_ITERS:-275}"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 3.0e-4
    --lr-decay-style cosine
    --min-lr 3.0e-5
    --lr-warmup-fraction .001
    --lr-decay-iters 430000
)

MODEL_PARALLEL_COMMON=(
    --tensor-model-parallel-size 1
    --use-distributed-optimizer
    --sequence-parallel
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --split 949,50,1
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model "$TOKENIZER_MODEL_PATH"
    --data-cache-path "$CHECKPOINT_PATH/data_cache"
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --log-throughput
    --save-interval 10000
    --eval-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

run_pretrain_gpt() {
    # $@: the layout-specific arguments, then the user's extra arguments.
    cd "$REPO_ROOT"
    exec torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
        "${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_COMMON[@]}" \
        "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@"
}
