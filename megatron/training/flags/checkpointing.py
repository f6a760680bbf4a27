"""Flags of saving and loading checkpoints."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.training.flags.schema import option, unavailable

_NON_PERSISTENT = ("non-persistent (local or in-memory) checkpoints are not implemented; save "
                   "more often with --save-interval")
_FROM_CHECKPOINT_ARGS = ("model flags are not read back from a checkpoint; give them on the "
                         "command line (tools/checkpoint_convert.py prints a checkpoint's)")
_CONVERT = "use tools/checkpoint_convert.py to change a checkpoint's format"


@dataclasses.dataclass
class CheckpointingArgs:
    save: Optional[str] = option(None, "directory to save checkpoints to")
    save_interval: Optional[int] = option(None, "iterations between checkpoints",
                                          flags=("--save-interval", "--persistent-save-interval"))
    no_save_optim: bool = option(False, "save no optimizer state")
    no_save_rng: bool = option(False, "save no RNG state")
    load: Optional[str] = option(None, "directory to load a checkpoint from")
    no_load_optim: bool = option(False, "do not load the optimizer state")
    no_load_rng: bool = option(False, "do not load the RNG state")
    non_persistent_save_interval: Optional[int] = unavailable(None, _NON_PERSISTENT)
    non_persistent_ckpt_type: Optional[str] = unavailable(
        None, _NON_PERSISTENT, choices=("global", "local", "in_memory"))
    non_persistent_global_ckpt_dir: Optional[str] = unavailable(None, _NON_PERSISTENT)
    non_persistent_local_ckpt_dir: Optional[str] = unavailable(None, _NON_PERSISTENT)
    non_persistent_local_ckpt_algo: str = unavailable("fully_parallel", _NON_PERSISTENT,
                                                      choices=("fully_parallel", "atomic"))
    finetune: bool = option(False, "load model weights only and start at iteration 0")
    pretrained_checkpoint: Optional[str] = option(
        None, "when --load holds no checkpoint, start from this one's weights as --finetune "
        "does")
    ckpt_step: Optional[int] = option(None, "iteration of --load to resume from (default: the "
                                      "one its latest_checkpointed_iteration.txt names)")
    perform_initialization: bool = option(True, "skip the random initialisation of the weights: "
                                          "they come from the checkpoint of --load (or "
                                          "--pretrained-checkpoint)",
                                          negative=("--no-initialization",))
    use_checkpoint_args: bool = unavailable(False, _FROM_CHECKPOINT_ARGS)
    use_mp_args_from_checkpoint_args: bool = unavailable(False, _FROM_CHECKPOINT_ARGS)
    use_tokenizer_model_from_checkpoint_args: bool = unavailable(
        True, _FROM_CHECKPOINT_ARGS,
        negative=("--no-use-tokenizer-model-from-checkpoint-args",))
    exit_on_missing_checkpoint: bool = option(False, "stop (exit code 0, as upstream) if --load "
                                              "holds no checkpoint instead of training from "
                                              "scratch")
    use_dist_ckpt_deprecated: bool = option(False, "", flags=("--use-dist-ckpt",),
                                            accepted="no effect, as upstream; the format is "
                                            "--ckpt-format")
    auto_detect_ckpt_format: bool = option(False, "", accepted="--load always detects the "
                                           "format")
    dist_ckpt_format_deprecated: Optional[str] = option(
        None, "", flags=("--dist-ckpt-format",),
        accepted="no effect, as upstream; the format is --ckpt-format")
    ckpt_format: str = option(
        "layout_free", "format --save writes: this tree's layout_free (weights and optimizer "
        "state loadable at any layout), upstream's torch_dist (weights, scheduler and the "
        "optimizer state in upstream's plain-optimizer layout, for megatron-core) or upstream's "
        "legacy torch (Megatron-LM's per-rank model_optim_rng.pt, and distrib_optim.pt with "
        "--use-distributed-optimizer); --load detects the format itself",
        choices=("layout_free", "torch", "torch_dist", "zarr"),
        refused="the zarr format (deprecated upstream) is not implemented; use torch_dist",
        refuse_if=lambda value: value == "zarr")
    ckpt_convert_format: Optional[str] = unavailable(None, _CONVERT,
                                                     choices=("torch", "torch_dist", "zarr"))
    ckpt_convert_save: Optional[str] = unavailable(None, _CONVERT)
    ckpt_convert_update_legacy_dist_opt_format: bool = unavailable(False, _CONVERT)
    ckpt_fully_parallel_save: bool = option(
        True, "spread the writing of replicated tensors (model and optimizer) over the ranks "
        "that hold them, balanced by bytes (else the first replica writes them); the files "
        "differ, their content does not", flags=("--ckpt-fully-parallel-save",),
        negative=("--no-ckpt-fully-parallel-save",))
    async_save: bool = option(False, "write checkpoints (torch_dist or layout_free) in the "
                              "background while training goes on; the tracker names one only "
                              "once complete on every rank, and the next save and every exit "
                              "wait for it")
    ckpt_fully_parallel_load: bool = option(
        False, "read each tensor of a checkpoint once per data-parallel group and broadcast it "
        "to the group's other ranks (else every replica reads it)")
    ckpt_assume_constant_structure: bool = option(
        False, "reuse the previous save's plan while no rank's part changes shape (torch's "
        "planner caching, where this torch has it), instead of exchanging plans every save")
    dist_ckpt_strictness: str = option(
        "assume_ok_unexpected", "what loading a distributed checkpoint does about tensors it "
        "and the run do not share: log_unexpected / log_all log those the run reads that the "
        "checkpoint lacks / and those no rank reads; raise_unexpected / raise_all stop the load "
        "on them instead; assume_ok_unexpected and ignore_all look for none (a weight the "
        "checkpoint lacks stops the load in every mode)",
        choices=("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
                 "raise_all", "return_unexpected", "return_all", "ignore_all"),
        refused="return_unexpected and return_all give the keys to a caller of "
        "dist_checkpointing.load, and pretrain_gpt.py's load has none: use log_all or raise_all",
        refuse_if=lambda value: value.startswith("return_"))
    # Later upstream's (not in core 0.11), set by its GPT CI configurations.
    save_retain_interval: Optional[int] = option(
        None, "after each save, delete the checkpoint saved before it unless its iteration is a "
        "multiple of this (a symbolic link is kept); a multiple of --save-interval")
    dist_ckpt_optim_fully_reshardable: bool = option(
        False, "", accepted="the optimizer state of every checkpoint format here already loads "
        "at any tp x pp x dp layout, with or without --use-distributed-optimizer")
    async_strategy: str = option(
        "nvrx", "", choices=("nvrx", "mcore"), accepted="either value: --async-save writes "
        "from threads of the training process (neither NVIDIA Resiliency Extension's nor "
        "megatron-core's asynchronous writer)")
    verify_integrity: bool = option(
        False, "", accepted="always on here: every save of every format writes a manifest of its "
        "files' sizes and checksums, and every load of such a checkpoint checks it first")
    use_persistent_ckpt_worker: bool = option(
        False, "", accepted="--async-save writes from threads of the training process, started "
        "per save; there is no worker process to keep")
    async_ckpt_use_cpu_shm: bool = option(
        False, "", accepted="--async-save writes from threads of the training process, so no "
        "tensor is handed to another process (no CUDA IPC to avoid)")
