"""Checks of the training loop's logging, profiling and housekeeping flags, each failing in
one line that names the flags (before any model is built)."""

from __future__ import annotations

from megatron.training.arguments import ArgumentError


def _positive(args, name: str, flag: str) -> None:
    value = getattr(args, name)
    if value is not None and value < 1:
        raise ArgumentError(f"{flag} must be a positive number of iterations, got {value}")


def validate_loop_args(args) -> None:
    _positive(args, "tensorboard_log_interval", "--tensorboard-log-interval")
    _positive(args, "tensorboard_queue_size", "--tensorboard-queue-size")
    _positive(args, "check_weight_hash_across_dp_replicas_interval",
              "--check-weight-hash-across-dp-replicas-interval")
    if args.log_interval < 1:
        raise ArgumentError(f"--log-interval must be at least 1, got {args.log_interval}")
    if args.train_sync_interval is not None and args.train_sync_interval < 0:
        raise ArgumentError(f"--train-sync-interval must be >= 0 (0: never), got "
                            f"{args.train_sync_interval}")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins < 0:
        raise ArgumentError(f"--exit-duration-in-mins must be >= 0, got "
                            f"{args.exit_duration_in_mins}")
    if args.manual_gc_interval < 0:
        raise ArgumentError(f"--manual-gc-interval must be >= 0 (0: only around evaluations), "
                            f"got {args.manual_gc_interval}")
    cuda = args.distributed_backend == "nccl"
    if args.record_memory_history and not cuda:
        raise ArgumentError("--record-memory-history records the CUDA allocator's history; "
                            "it needs CUDA (--distributed-backend nccl)")
    if args.profile:
        if args.profile_step_end <= args.profile_step_start or args.profile_step_start < 0:
            raise ArgumentError(f"--profile needs 0 <= --profile-step-start < "
                                f"--profile-step-end, got {args.profile_step_start} and "
                                f"{args.profile_step_end}")
        if args.use_pytorch_profiler and not args.tensorboard_dir:
            raise ArgumentError("--use-pytorch-profiler writes its trace to --tensorboard-dir; "
                                "set it")
        if not args.use_pytorch_profiler and not cuda:
            raise ArgumentError("--profile without --use-pytorch-profiler opens the CUDA "
                                "profiler's range (for nsys) and needs CUDA; on CPU add "
                                "--use-pytorch-profiler")
    if args.deterministic_mode:
        nondeterministic = [flag for flag, on in (
            ("--use-flash-attn", args.use_flash_attn),
            ("--cross-entropy-loss-fusion", args.cross_entropy_loss_fusion)) if on]
        if nondeterministic:
            raise ArgumentError(f"--deterministic-mode: {', '.join(nondeterministic)} "
                                f"computes in a nondeterministic order; leave it off")
