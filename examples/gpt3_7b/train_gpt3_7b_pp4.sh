#!/usr/bin/env bash
# 7B GPT, pipeline size 4 (dp 2 on 8 GPUs), upstream's default overlapped p2p.
#   bash examples/gpt3_7b/train_gpt3_7b_pp4.sh CKPT TB_LOGS DATA_PREFIX TOKENIZER_MODEL [args...]
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

run_pretrain_gpt \
    --pipeline-model-parallel-size 4 \
    "$@"
