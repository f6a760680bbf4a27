"""Command-line arguments: upstream Megatron-LM's flags, declared as typed configs.

Each group of flags is a dataclass whose fields are the flags (field ``seed`` is ``--seed``),
with help text, choices, extra spellings and how this tree supports it in the field's metadata
(``megatron.training.flags``). The parser is generated from these dataclasses, so every flag is
declared once, and ``config_from_args`` turns the parsed namespace back into the typed configs.
``get_args()`` keeps upstream's flat namespace for code that expects it.

``validate_args`` first refuses every flag of a feature this tree does not have, all in one
message, then derives what upstream derives (rank, world size, data-parallel size, virtual
pipeline size, upstream's older spellings); an inconsistent combination is an error that names
the flags (the checks, by subject, are in ``megatron.training.flag_checks``). It runs on every
rank before any process group exists.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Optional

from megatron.training.batch_schedule import step_schedule
from megatron.training.data_sources import (
    DataSourceError, check_data_sources, check_training_data,
)
from megatron.training.flag_checks.layout import check_layout, resolve_spellings
from megatron.training.flag_checks.runtime import (
    check_checkpointing, check_fp8, check_model_flags, check_precision, check_rerun, check_runtime,
)
from megatron.training.flag_checks.schedule import (
    check_batch_sizes, check_learning_rate_schedule, check_schedule,
)
from megatron.training.flags.groups import ARGUMENT_GROUPS
from megatron.training.flags.schema import (
    ArgumentError, add_config_arguments, config_from_args, flag_name, refusals,
)

__all__ = [
    "ARGUMENT_GROUPS", "ArgumentError", "add_config_arguments", "config_from_args", "flag_name",
    "parse_args", "validate_args", "validate_training_args", "agreement_items", "build_parser",
]


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line ends in its error line and where to look, not in the
    usage of all 400-odd flags (which every rank of a launch would print)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments"):
            message += ("\n(every flag of Megatron-LM core 0.11 parses here, and a few of later "
                        "versions: docs/flags.md; python tools/check_args.py <flags> reports "
                        "them one by one)")
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    parser = _Parser(description="Megatron SafePipe arguments", allow_abbrev=False)
    for title, cls in ARGUMENT_GROUPS:
        add_config_arguments(parser, title, cls)
    # Read when the parser is built, as upstream does, not when the flag table was imported.
    parser.set_defaults(local_rank=int(os.getenv("LOCAL_RANK", "0")))
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def parse_args(extra_args_provider: Optional[Callable] = None, ignore_unknown_args: bool = False,
               argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse ``argv`` (default: ``sys.argv[1:]``) into upstream's flat namespace."""
    parser = build_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    return args


def _refuse_unavailable(args: argparse.Namespace) -> None:
    lines = refusals(args, ARGUMENT_GROUPS)
    if lines:
        raise ArgumentError("\n".join(lines))


def validate_args(args: argparse.Namespace, defaults: Optional[dict] = None) -> argparse.Namespace:
    """Refuse unavailable features, apply ``defaults`` to flags left unset, check combinations
    and fill in derived values."""
    _refuse_unavailable(args)
    if args.tokenizer_type is None and args.mock_data and args.vocab_size:
        args.tokenizer_type = "NullTokenizer"  # synthetic data only needs a vocabulary size
    for key, value in (defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    resolve_spellings(args)
    check_layout(args)
    check_precision(args)
    check_runtime(args)
    check_model_flags(args)
    check_checkpointing(args)
    check_rerun(args)
    check_schedule(args)
    try:
        check_data_sources(args)
    except DataSourceError as error:
        raise ArgumentError(str(error)) from None
    _fill_model_defaults(args)
    check_fp8(args)
    return args


def _fill_model_defaults(args: argparse.Namespace) -> None:
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.num_attention_heads and args.hidden_size:
        if args.kv_channels is None:
            args.kv_channels = args.hidden_size // args.num_attention_heads
        if not args.group_query_attention:
            args.num_query_groups = args.num_attention_heads
    if args.hidden_size and args.ffn_hidden_size is None:
        if args.swiglu:
            # As upstream: two thirds of 4h (SwiGLU has three matrices), rounded to 64.
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.step_batch_size_schedule is not None:
        # The batch size the schedule ends at, as a ramp's is its last (later upstream sets
        # micro x data-parallel size, which would size the default evaluation batch and turn
        # iteration-counted schedules into samples by one microbatch step).
        args.global_batch_size = step_schedule(args)[-1][1]
    if args.micro_batch_size is not None and args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.eval_global_batch_size is None:
        args.eval_global_batch_size = args.global_batch_size


_REQUIRED_FOR_TRAINING = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                          "micro_batch_size", "lr")


def validate_training_args(args: argparse.Namespace, read_files: bool = True) -> None:
    """What pretraining needs on top of ``validate_args``; errors name the flags. With
    ``read_files`` False the files of data arguments are not opened (tools/check_args.py:
    the paths are the cluster's)."""
    missing = [flag_name(name) for name in _REQUIRED_FOR_TRAINING if getattr(args, name) is None]
    if args.train_iters is None and args.train_samples is None:
        missing.append("--train-iters (or --train-samples)")
    if missing:
        raise ArgumentError(f"pretraining needs {', '.join(missing)}")
    check_batch_sizes(args)
    if args.max_position_embeddings < args.seq_length and args.position_embedding_type == \
            "learned_absolute":
        raise ArgumentError(f"--max-position-embeddings {args.max_position_embeddings} is smaller "
                            f"than --seq-length {args.seq_length}")
    try:
        check_training_data(args, read_files)
    except DataSourceError as error:
        raise ArgumentError(str(error)) from None
    if args.tokenizer_type is None and not (args.mock_data and args.vocab_size):
        raise ArgumentError("pretraining needs --tokenizer-type (or --mock-data with "
                            "--vocab-size)")
    if args.wandb_project and not args.wandb_exp_name:
        raise ArgumentError("--wandb-project needs --wandb-exp-name")
    check_learning_rate_schedule(args)


def agreement_items(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The arguments every rank must have been started with, in declaration order.

    Per-rank values (rank, local rank) are left out; everything else must be identical.
    """
    skip = {"rank", "local_rank"}
    return [(name, value) for name, value in vars(args).items()
            if name not in skip and not callable(value)]
