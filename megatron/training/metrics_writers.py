"""Where training scalars go: TensorBoard (``--tensorboard-dir``) and Weights & Biases
(``--wandb-project``), both optional packages.

``start()`` runs once at start-up, before any model is built, and only the last rank writes.
A requested backend whose package is missing costs one warning line, not the job.

Both backends get every scalar at its iteration. Given the consumed samples too, TensorBoard
also plots the scalar against them as ``<name> vs samples`` (upstream's second series);
wandb, whose steps must only grow, gets ``samples vs steps`` instead. Text (the arguments)
goes to TensorBoard only.
"""

from __future__ import annotations

import argparse
import importlib
import os
from types import ModuleType
from typing import Any, Optional, Protocol

from megatron.training.utils import is_last_rank


class MetricsWriter(Protocol):
    def add_scalar(self, name: str, value: float, iteration: int,
                   samples: Optional[int] = None) -> None: ...

    def add_text(self, name: str, text: str, iteration: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    def __init__(self, tensorboard: ModuleType, log_dir: str, max_queue: int = 1000):
        self._writer = tensorboard.SummaryWriter(log_dir=log_dir, max_queue=max_queue)

    def add_scalar(self, name: str, value: float, iteration: int,
                   samples: Optional[int] = None) -> None:
        self._writer.add_scalar(name, value, iteration)
        if samples is not None:
            self._writer.add_scalar(f"{name} vs samples", value, samples)

    def add_text(self, name: str, text: str, iteration: int) -> None:
        self._writer.add_text(name, text, global_step=iteration)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    def __init__(self, wandb: ModuleType, args: argparse.Namespace):
        self._wandb = wandb
        save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        entity = {"entity": args.wandb_entity} if args.wandb_entity else {}
        wandb.init(project=args.wandb_project, name=args.wandb_exp_name, dir=save_dir,
                   config={key: _plain(value) for key, value in vars(args).items()
                           if not callable(value)}, **entity)
        self._samples_logged_at: Optional[int] = None

    def add_scalar(self, name: str, value: float, iteration: int,
                   samples: Optional[int] = None) -> None:
        if samples is not None and self._samples_logged_at != iteration:
            self._wandb.log({"samples vs steps": samples}, step=iteration)
            self._samples_logged_at = iteration
        self._wandb.log({name: value}, step=iteration)

    def add_text(self, name: str, text: str, iteration: int) -> None:
        pass  # the arguments are already the run's config (init above)

    def flush(self) -> None:
        pass  # wandb sends in the background

    def close(self) -> None:
        self._wandb.finish()


class FanOut:
    """Several backends behind one writer, so the trainer never asks which are on."""

    def __init__(self, writers: list[MetricsWriter]):
        self._writers = writers

    def add_scalar(self, name: str, value: float, iteration: int,
                   samples: Optional[int] = None) -> None:
        for writer in self._writers:
            writer.add_scalar(name, value, iteration, samples)

    def add_text(self, name: str, text: str, iteration: int) -> None:
        for writer in self._writers:
            writer.add_text(name, text, iteration)

    def flush(self) -> None:
        for writer in self._writers:
            writer.flush()

    def close(self) -> None:
        for writer in self._writers:
            writer.close()


def _plain(value: Any) -> Any:
    """A value wandb can serialise: dtypes, enums and the like become their str()."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return str(value)


def _optional_import(name: str) -> Optional[ModuleType]:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def build_writer(args: argparse.Namespace) -> Optional[MetricsWriter]:
    """The writer for the requested backends that are installed (call on the writing rank)."""
    writers: list[MetricsWriter] = []
    if args.tensorboard_dir:
        tensorboard = _optional_import("torch.utils.tensorboard")
        if tensorboard is None:
            print("WARNING: --tensorboard-dir is set but TensorBoard is not installed; training "
                  "on without TensorBoard logs (pip install tensorboard)", flush=True)
        else:
            writers.append(TensorBoardWriter(tensorboard, args.tensorboard_dir,
                                             args.tensorboard_queue_size))
    if args.wandb_project:
        wandb = _optional_import("wandb")
        if wandb is None:
            print("WARNING: --wandb-project is set but wandb is not installed; training on "
                  "without wandb logs (pip install wandb)", flush=True)
        else:
            writers.append(WandbWriter(wandb, args))
    if not writers:
        return None
    return writers[0] if len(writers) == 1 else FanOut(writers)


_WRITER: Optional[MetricsWriter] = None


def start(args: argparse.Namespace) -> None:
    """Open the job's writer on the last rank, the one that prints the log line."""
    global _WRITER
    _WRITER = build_writer(args) if is_last_rank() else None


def get_writer() -> Optional[MetricsWriter]:
    return _WRITER


def write_args(args: argparse.Namespace, iteration: int) -> None:
    """Every argument as text, as upstream records a run's configuration in TensorBoard."""
    if _WRITER is not None:
        for name, value in vars(args).items():
            _WRITER.add_text(name, str(value), iteration)


def finish() -> None:
    """Flush and close the job's writer (once, at the end of the run or before an exit)."""
    global _WRITER
    if _WRITER is not None:
        _WRITER.close()
        _WRITER = None
