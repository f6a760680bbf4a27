"""Command-line arguments: upstream Megatron-LM's flags, declared as typed configs.

Each group of flags is a dataclass whose fields are the flags (field ``seed`` is ``--seed``),
with help text, choices and extra spellings in the field's metadata. The parser is generated
from these dataclasses, so every flag is declared once, and ``config_from_args`` turns the
parsed namespace back into the typed configs the rest of the tree consumes. ``get_args()``
keeps upstream's flat namespace for code that expects it.

``validate_args`` derives what upstream derives (rank, world size, data-parallel size,
virtual pipeline size); an inconsistent combination is an error that names the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Callable, Optional

import torch


def option(default: Any, help: str, *, choices: Optional[tuple] = None,
           flags: Optional[tuple[str, ...]] = None) -> Any:
    """A dataclass field that is also a command-line flag."""
    return dataclasses.field(default=default,
                             metadata={"help": help, "choices": choices, "flags": flags})


@dataclasses.dataclass
class ModelShapeArgs:
    num_layers: Optional[int] = option(None, "number of transformer layers")


@dataclasses.dataclass
class ParallelismArgs:
    tensor_model_parallel_size: int = option(1, "tensor model-parallel degree")
    pipeline_model_parallel_size: int = option(1, "pipeline model-parallel degree (stages)")
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        None, "layers per virtual pipeline stage (interleaved schedule)")
    num_virtual_stages_per_pipeline_rank: Optional[int] = option(
        None, "virtual pipeline stages (model chunks) per pipeline rank (interleaved schedule)")
    context_parallel_size: int = option(1, "context-parallel degree (only 1 is supported)")
    sequence_parallel: bool = option(False, "shard activations along the sequence in TP regions")
    use_tp_pp_dp_mapping: bool = option(
        False, "number ranks tp, cp, pp, dp (fastest first) instead of tp, cp, dp, pp")


@dataclasses.dataclass
class DistributedArgs:
    distributed_backend: str = option("nccl", "torch.distributed backend",
                                      choices=("nccl", "gloo"))
    distributed_timeout_minutes: int = option(
        10, "timeout of collectives and p2p once training runs")
    distributed_startup_timeout_seconds: float = option(
        300.0, "how long start-up waits for every rank to arrive and agree before failing "
               "with the names of the missing or disagreeing ranks")
    local_rank: int = option(int(os.getenv("LOCAL_RANK", "0")),
                             "local rank (default: $LOCAL_RANK, set by torchrun)")


@dataclasses.dataclass
class RandomArgs:
    seed: int = option(1234, "random seed for python, numpy and torch")
    data_parallel_random_init: bool = option(
        False, "initialise parameters differently on each data-parallel rank")


ARGUMENT_GROUPS: tuple[tuple[str, type], ...] = (
    ("model shape", ModelShapeArgs),
    ("parallelism", ParallelismArgs),
    ("distributed", DistributedArgs),
    ("randomness", RandomArgs),
)

def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _add_field(group, field: dataclasses.Field, annotation) -> None:
    meta = field.metadata
    names = meta.get("flags") or (flag_name(field.name),)
    kwargs: dict[str, Any] = {"dest": field.name, "default": field.default, "help": meta["help"]}
    base = typing.get_args(annotation)[0] if typing.get_origin(annotation) is typing.Union \
        else annotation
    if base is bool:
        kwargs["action"] = "store_true"
    else:
        kwargs["type"] = base
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
    group.add_argument(*names, **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser, title: str, cls: type) -> None:
    """Add one flag per field of the dataclass ``cls``, in an argument group ``title``."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        _add_field(group, field, hints[field.name])


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron SafePipe arguments",
                                     allow_abbrev=False)
    for title, cls in ARGUMENT_GROUPS:
        add_config_arguments(parser, title, cls)
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


def config_from_args(args: argparse.Namespace, cls: type):
    """The typed config ``cls`` with the values of ``args``."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


class ArgumentError(ValueError):
    """Arguments that cannot work together; the message names the flags."""


def _derive_virtual_pipeline_size(args: argparse.Namespace) -> Optional[int]:
    per_stage = args.num_layers_per_virtual_pipeline_stage
    per_rank = args.num_virtual_stages_per_pipeline_rank
    pp = args.pipeline_model_parallel_size
    if per_stage is not None and per_rank is not None:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage and "
                            "--num-virtual-stages-per-pipeline-rank are alternatives; give one")
    if per_stage is None and per_rank is None:
        return None
    if pp < 2:
        raise ArgumentError(f"interleaving (virtual pipeline stages) needs "
                            f"--pipeline-model-parallel-size >= 2, got {pp}")
    if per_rank is not None:
        if per_rank < 1:
            raise ArgumentError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {per_rank}")
        return per_rank if per_rank > 1 else None
    if args.num_layers is None:
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage needs --num-layers")
    if per_stage < 1 or args.num_layers % pp or (args.num_layers // pp) % per_stage:
        raise ArgumentError(
            f"--num-layers {args.num_layers} must split evenly into "
            f"--pipeline-model-parallel-size {pp} stages of "
            f"--num-layers-per-virtual-pipeline-stage {per_stage} layers each")
    chunks = args.num_layers // pp // per_stage
    return chunks if chunks > 1 else None


def validate_args(args: argparse.Namespace, defaults: Optional[dict] = None) -> argparse.Namespace:
    """Apply ``defaults`` to flags left unset, check combinations, fill in derived values."""
    for key, value in (defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.rank = int(os.getenv("RANK", "0"))
    args.world_size = int(os.getenv("WORLD_SIZE", "1"))
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size"):
        if getattr(args, dest) < 1:
            raise ArgumentError(f"{flag_name(dest)} must be >= 1, got {getattr(args, dest)}")
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * args.context_parallel_size)
    if args.world_size % model_parallel:
        raise ArgumentError(
            f"the world size ({args.world_size} ranks, $WORLD_SIZE) is not divisible by "
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} x "
            f"--context-parallel-size {args.context_parallel_size} = {model_parallel}")
    args.data_parallel_size = args.world_size // model_parallel
    args.virtual_pipeline_model_parallel_size = _derive_virtual_pipeline_size(args)
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        # As upstream: sequence parallelism only exists inside tensor-parallel regions.
        args.sequence_parallel = False
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise ArgumentError("--distributed-backend nccl needs CUDA devices and none is "
                            "visible; on CPU use --distributed-backend gloo")
    if args.distributed_startup_timeout_seconds <= 0 or args.distributed_timeout_minutes <= 0:
        raise ArgumentError("--distributed-startup-timeout-seconds and "
                            "--distributed-timeout-minutes must be positive")
    return args


def agreement_items(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The arguments every rank must have been started with, in declaration order.

    Per-rank values (rank, local rank) are left out; everything else must be identical.
    """
    skip = {"rank", "local_rank"}
    return [(name, value) for name, value in vars(args).items()
            if name not in skip and not callable(value)]
