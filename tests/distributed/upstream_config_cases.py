"""Upstream Megatron-LM's own GPT CI configurations, scaled down to run in seconds.

A configuration (tests/data/upstream_core_v0_11/gpt_ci_configs.jsonl, or later upstream's in
tests/data/upstream_main/) keeps every flag it sets
-- parallel layout, precision, schedule, logging, checkpoint format, model features -- except
the sizes, the paths and the backend: the model shrinks to hidden 64, 4 heads and sequences of
64 tokens, iterations to 2, the data to the quickstart corpus and its SentencePiece tokenizer,
the data-parallel size to 2 where a flag depends on it and 1 elsewhere (the number of
microbatches per iteration, up to 8, and the batch ramp-up keep their shape), tensor and pipeline
parallelism to at most 4 each, and the ranks to at most 8.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DATA = Path(__file__).resolve().parents[1] / "data"
# Upstream's GPT CI configurations, and the flag set of its examples/gpt3 175B script; later
# upstream's (main) named "main/<name>".
CONFIGS = {config["name"]: config for name in ("gpt_ci_configs.jsonl", "examples.jsonl")
           for config in map(json.loads, (_DATA / "upstream_core_v0_11" / name).open())}
CONFIGS.update({f"main/{config['name']}": config for config in map(
    json.loads, (_DATA / "upstream_main" / "gpt_ci_configs.jsonl").open())})

# What runs here: (configuration, flags added to it, why the flags).
REPRESENTATIVE = {
    "tp1_pp4_vp1_dist_opt_overlap": (
        "gpt3_mr_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather_"
        "dgx_a100_1N8G", ()),
    "tp2_pp2_sequence_parallel": (
        "gpt3_mr_mcore_te_tp2_pp2_dgx_a100_1N8G", ("--sequence-parallel",)),
    "tp1_pp4_uneven_first_last": ("gpt3_mr_mcore_te_tp1_pp4_vp1_uneven_pipeline_dgx_a100_1N8G",
                                  ()),
    "tp1_pp4_vp2_account_for_embedding_and_loss": (
        "gpt3_mr_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split_"
        "dgx_a100_1N8G", ()),
    "tp1_pp4_vp1_decoupled_lr": ("gpt3_mr_mcore_te_tp1_pp4_vp1_decoupled_lr_dgx_a100_1N8G", ()),
    "tp1_pp4_vp1_per_token_loss": (
        "gpt3_mr_mcore_te_tp1_pp4_vp1_calculate_per_token_loss_dgx_a100_1N8G", ()),
    "tp4_pp1_qk_layernorm_test_mode": (
        "gpt3_mr_mcore_te_tp4_pp1_qk_layernorm_test_mode_dgx_a100_1N8G", ()),
    "tp1_pp2_rope_interleaved_no_fusion": (
        "gpt3_mr_mcore_te_tp1_pp2_rope_embeddings_interleaved_no_fusion_dgx_a100_1N8G", ()),
    "tp1_pp4_vp1_tunable_overlap": ("gpt3_mr_mcore_te_tp1_pp4_vp1_tunable_overlap_dgx_a100_1N8G",
                                    ()),
    "15b_release_rampup_samples": ("gpt3_15b_8t_release_sm", ()),
    "gpt3_175b_example": ("examples/gpt3/train_gpt3_175b_distributed.sh", ()),
    # Later upstream's: --dist-ckpt-strictness log_all, background saves, no gloo groups.
    "main_tp1_pp4_vp1_dist_opt_overlap_log_all": (
        "main/gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather", ()),
    "main_tp2_pp2_verify_integrity": ("main/gpt3_mcore_te_tp2_pp2_resume_torch_dist", ()),
    # Context parallelism: with tensor parallelism, and cp 4 as 2 x 2 (a2a+p2p) at pp 2.
    "tp2_pp1_cp2": ("gpt3_mr_mcore_te_tp2_pp1_cp2_nondeterministic_dgx_a100_1N8G", ()),
    "tp1_pp2_cp4_a2a_p2p": ("gpt3_mr_mcore_te_tp1_pp2_cp4_a2a_p2p_nondeterministic_dgx_a100_1N8G",
                            ()),
    "main_tp2_pp2_cp2_per_token_loss": (
        "main/gpt3_mcore_te_tp2_pp2_cp2_calculate_per_token_loss", ()),
    # FP8 as upstream's weekly H100 runs ask for it: hybrid, delayed scaling (the default
    # recipe) over an amax history of 1024 taking its largest, at tp 2 x pp 2 with sequence
    # parallelism.
    "tp2_pp2_fp8_sequence_parallel": (
        "gpt3_345m_weekly_dgx_h100_1N8G_mcore_tp2_pp2_fp8_tp_pp_sp", ()),
    # The legacy GPT's (--use-legacy-models: the megatron-core GPT in its place), fp16 with
    # query-key layer scaling, interleaved.
    "legacy_tp1_pp4_vp1_fp16": ("gpt3_mr_tp1_pp4_vp1_dgx_a100_1N8G", ()),
    # Later upstream's 15B release recipe: its batch size follows a step schedule.
    "main_15b_release_step_schedule": ("main/gpt3_15b_8t_release_sm", ()),
}

# Flags whose values are paths, sizes or the machine's; replaced below.
_REPLACED = {"--data-path", "--vocab-file", "--merge-file", "--tokenizer-type",
             "--tokenizer-model", "--data-cache-path", "--save", "--load", "--tensorboard-dir",
             "--wandb-project", "--wandb-exp-name", "--distributed-backend", "--num-workers",
             "--hidden-size", "--num-attention-heads", "--num-query-groups", "--seq-length",
             "--max-position-embeddings", "--micro-batch-size", "--global-batch-size",
             "--train-iters", "--train-samples", "--eval-iters", "--eval-interval",
             "--step-batch-size-schedule",
             "--save-interval", "--log-interval", "--tensor-model-parallel-size",
             "--rampup-batch-size", "--num-layers", "--lr-warmup-samples", "--lr-decay-samples",
             "--distributed-timeout-minutes", "--pipeline-model-parallel-size"}
_WORLD = 8  # every configuration is one node of 8 GPUs
_MAX_RANKS = 8
# Flags whose behaviour depends on the data-parallel group.
_DATA_PARALLEL_FLAGS = {"--use-distributed-optimizer", "--overlap-grad-reduce",
                        "--overlap-param-gather", "--num-distributed-optimizer-instances",
                        "--calculate-per-token-loss", "--rampup-batch-size"}


@dataclass(frozen=True)
class ScaledRun:
    argv: list[str]
    world_size: int
    env: dict[str, str]


def _split(argv: list[str]) -> dict[str, list[str]]:
    """``--flag v1 v2 --switch`` -> {"--flag": ["v1", "v2"], "--switch": []}."""
    flags: dict[str, list[str]] = {}
    current = None
    for word in argv:
        if word.startswith("--"):
            current = word
            flags[current] = []
        else:
            flags[current].append(word)
    return flags


def scaled_down(name: str, extra: tuple[str, ...], *, data: Path, out: Path,
                backend: str = "gloo") -> ScaledRun:
    config = CONFIGS[name]
    flags = _split(config["argv"])
    value = lambda flag, default: int(flags.get(flag, [default])[0])  # noqa: E731
    tp, pp = value("--tensor-model-parallel-size", 1), value("--pipeline-model-parallel-size", 1)
    cp = value("--context-parallel-size", 1)  # kept: its sizes are what the case is about
    dp = max(1, _WORLD // (tp * pp * cp))
    micro = value("--micro-batch-size", 1)
    microbatches = min(8, value("--global-batch-size", micro * dp) // (micro * dp))
    instances = value("--num-distributed-optimizer-instances", 1)
    # Data parallelism only where the configuration does something with it, and at most 8
    # ranks in all (two cores run them): tensor parallelism gives way first.
    new_dp = max(min(dp, 2), instances) if _DATA_PARALLEL_FLAGS & flags.keys() else 1
    new_tp, new_pp = min(tp, 4), min(pp, 4)
    while new_tp * new_pp * new_dp * cp > _MAX_RANKS and new_tp > 1:
        new_tp //= 2
    layers = value("--num-layers", 4)
    argv = [word for flag, values in flags.items() if flag not in _REPLACED
            for word in (flag, *values)]
    argv += [
        "--tensor-model-parallel-size", str(new_tp), "--pipeline-model-parallel-size",
        str(new_pp), "--num-layers", str(layers if layers <= 12 else 4),
        "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "1", "--eval-iters", "1",
        "--eval-interval", "1000", "--save-interval", "1000", "--log-interval", "1",
        "--distributed-timeout-minutes", "5",
        "--data-path", str(data / "corpus_text_document"), "--tokenizer-type", "Llama2Tokenizer",
        "--tokenizer-model", str(data / "tokenizer.model"),
        "--data-cache-path", str(out / "cache"), "--save", str(out / "ckpt"),
        "--load", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb"),
        "--distributed-backend", backend, "--num-workers", "0", *extra]
    if "--step-batch-size-schedule" in flags:
        # The same shape: a batch size doubling once, here after three batches' tokens.
        start = max(1, microbatches // 2) * new_dp
        argv += ["--step-batch-size-schedule", f"0:{start} {3 * start * 64}:{2 * start}"]
    else:
        argv += ["--global-batch-size", str(microbatches * new_dp)]
    if "--num-query-groups" in flags:
        argv += ["--num-query-groups", str(new_tp)]
    if "--rampup-batch-size" in flags:
        # The ramp keeps its shape: a third of the batch first, full after a few iterations.
        step = microbatches * new_dp // 3
        argv += ["--rampup-batch-size", str(step), str(step), str(4 * step)]
    if "--train-samples" in flags:
        argv += ["--train-samples", str(4 * microbatches * new_dp)]
        if "--lr-warmup-samples" in flags:
            argv += ["--lr-warmup-samples", "2"]
    else:
        argv += ["--train-iters", "4" if "--rampup-batch-size" in flags else "2"]
    if "--fp16" in flags and "--initial-loss-scale" not in flags:
        # A few iterations of a tiny model would all be skipped at fp16's 2**32 start.
        argv += ["--initial-loss-scale", "4096"]
    env = dict(config["env"]) if backend == "nccl" else {}
    if env.get("NCCL_ALGO") == "Tree":
        # Upstream's CI pins Tree; NCCL 2.28 has no Tree broadcast or all-gather (pretrain_gpt
        # refuses it there, naming Ring), and Ring is as deterministic.
        env["NCCL_ALGO"] = "Ring"
    return ScaledRun(argv, new_tp * new_pp * new_dp * cp, env)
