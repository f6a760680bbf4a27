#!/usr/bin/env bash
# 7B GPT, pipeline size 2 with two virtual stages per rank, variable sequence lengths and
# batched p2p: the combination upstream Megatron-LM hangs, crashes or silently corrupts on
# (issue #1450), correct here.
#   bash examples/gpt3_7b/train_gpt3_7b_pp2_vpp2.sh CKPT TB_LOGS DATA_PREFIX TOKENIZER_MODEL [args...]
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Two chunks per rank: (layers / pipeline size) / 2 layers per virtual stage.
LAYERS_PER_VIRTUAL_STAGE=$(( ${NUM_LAYERS:-32} / 2 / 2 ))

run_pretrain_gpt \
    --pipeline-model-parallel-size 2 \
    --num-layers-per-virtual-pipeline-stage "$LAYERS_PER_VIRTUAL_STAGE" \
    --variable-seq-lengths \
    --no-overlap-p2p-communication \
    "$@"
