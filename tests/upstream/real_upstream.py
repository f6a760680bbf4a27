"""Real Megatron-LM core_v0.11.0 and this tree, trained, saved and resumed side by side on one GPU.

Upstream runs as users run it: its own ``pretrain_gpt.py`` from a copy of the checkout named by
``MEGATRON_LM_TREE`` (``upstream_tree``), in processes whose ``PYTHONPATH`` holds only that copy
and the few packages it imports. Several ranks share the GPU as one-GPU "hosts"
(``tools/launch_nccl_ranks.py``), so tp/pp/dp layouts run on one device. Both trees read the
same corpus (``tiny_corpus``) with the same flags, fp32, no dropout, TF32 off.

Upstream 0.11 meets newer software than it was released with; the harness adapts its copy (never
this tree, never the checkout), each change stated in ``SHIMS``:

* torch >= 2.6 changed the private ``_write_item`` its torch_dist writer calls (a transforms
  object first, a serialization format last; later megatron-core versions pass both);
* torch >= 2.6 loads with ``weights_only=True`` by default, which its own ``torch.load`` calls
  predate: ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` in upstream's environment only;
* torch 2.11's DCP writer keeps only the fields ``Metadata`` declares, which loses the
  ``mcore_data`` 0.11 sets on it (the shapes of flattened optimizer tensors, without which it
  cannot load its own distributed optimizer's state): a subclass declares it, as later
  megatron-core versions do;
* numpy >= 2 removed ``np.product`` (its dist-checkpointing checks of flattened tensors);
* without apex or Transformer Engine its optimizer is torch's AdamW, which keeps a 0-d ``step``
  per parameter that 0.11's distributed optimizer cannot flatten into ``fully_sharded_model_space``,
  copies into nothing when loading its state, and lacks before the first step: the step stays in
  the parameter groups (as with apex's Adam, and as later megatron-core versions do);
* in fp32 training its legacy ``distrib_optim.pt`` load copies into the main parameters, which
  are then the model's own parameters, outside ``torch.no_grad`` (autograd refuses).

Upstream asserts that ``--train-iters`` equals the checkpoint's, so a first run stops with
``--exit-interval`` (after its ``--save-interval`` save, which upstream requires with
``--save``), never with fewer iterations.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from tests.distributed.test_trainer import losses
from tests.gpu.nccl_support import REPO, launch
from tests.upstream.tiny_corpus import data_flags

UPSTREAM, OURS = "upstream", "ours"
SAVE_AT, TRAIN_ITERS = 4, 8
DEADLINE_S = 300
UPSTREAM_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
# Printed by upstream's initialisation only: the losses read are upstream's own.
UPSTREAM_MARK = "> initialized tensor model parallel with size"


@dataclass(frozen=True)
class Shim:
    """One textual change to the copy of upstream: ``old`` replaced by ``new`` (``old`` None:
    ``new`` appended), found exactly ``count`` times (None: at least once)."""

    path: str
    old: Optional[str]
    new: str
    why: str
    count: Optional[int] = 1


_WRITE_ITEM_ADAPTER = '''

# Added by this tree's test harness (not upstream): torch >= 2.6 passes stream transforms first
# and a serialization format last.
def _harness_write_item(stream, data, write_item, storage_key, _torch_write_item=_write_item):
    import inspect

    from torch.distributed.checkpoint import filesystem

    if len(inspect.signature(_torch_write_item).parameters) == 4:
        return _torch_write_item(stream, data, write_item, storage_key)
    return _torch_write_item(filesystem._StorageWriterTransforms(), stream, data, write_item,
                             storage_key, filesystem.SerializationFormat.TORCH_SAVE)


_write_item = _harness_write_item
'''
_DECLARED_MCORE_DATA = '''

# Added by this tree's test harness (not upstream): torch 2.11's DCP writer keeps only the
# fields Metadata declares, so megatron-core's flattened-tensor shapes must be one.
@dataclass
class HarnessMetadata(Metadata):
    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None
'''
_MCORE_DATA_SET = "        metadata.mcore_data = dict(ChainMap(*(plan.mcore_data for plan in all_plans)))\n"
_DIST_OPTIMIZER = "megatron/core/optimizer/distrib_optimizer.py"
_STEPS = 'steps = list(set([s["step"].item() for s in inner_state_dict["state"].values()]))'
SHIMS = (
    Shim("megatron/core/dist_checkpointing/strategies/filesystem_async.py", None,
         _WRITE_ITEM_ADAPTER, "torch >= 2.6 changed _write_item's arguments"),
    Shim("megatron/core/dist_checkpointing/strategies/torch.py", _MCORE_DATA_SET,
         _MCORE_DATA_SET.replace("metadata.mcore_data = ", "metadata = HarnessMetadata(\n"
                                 "            **vars(metadata), mcore_data=") + "        )\n",
         "torch 2.11 writes only Metadata's declared fields (mcore_data was lost)"),
    Shim("megatron/core/dist_checkpointing/strategies/torch.py", None, _DECLARED_MCORE_DATA,
         "the declared mcore_data of the shim above"),
    *(Shim(f"megatron/core/dist_checkpointing/{name}", "np.product(", "np.prod(",
           "numpy >= 2 removed np.product", count=None)
      for name in ("mapping.py", "validation.py", "exchange_utils.py")),
    Shim(_DIST_OPTIMIZER, _STEPS, _STEPS + " or [0.0]  # harness: no state before a step",
         "torch AdamW: no per-parameter step before the first step (loading)"),
    Shim(_DIST_OPTIMIZER, 'tensors["fp32_param"] = tensors.pop("param")\n',
         'tensors["fp32_param"] = tensors.pop("param")\n'
         '                        tensors.pop("step", None)  # harness: kept in param groups\n',
         "torch AdamW: a 0-d step cannot be flattened (fully_sharded_model_space)"),
    Shim(_DIST_OPTIMIZER, "                dst_tensors[key].copy_(tensors[key])\n",
         "                if key in tensors:  # harness: the step comes from the groups\n"
         "                    with torch.no_grad():  # harness: fp32 main params are leaves\n"
         "                        dst_tensors[key].copy_(tensors[key])\n",
         "torch AdamW: saved parameter state holds no step to copy; fp32 training: the legacy "
         "distrib_optim.pt load copies into parameters with autograd on"),
)


def build_dataset_helpers(copy: Path, packages: list[Path]) -> None:
    """Compile upstream's C++ dataset helpers in ``copy`` now (its rank 0 would on first use),
    so that runs sharing the copy never build them at the same time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [copy, *packages]))}
    done = subprocess.run(["make", "-C", str(copy / "megatron" / "core" / "datasets")],
                          capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"upstream's dataset helpers did not build: {done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")


def prepare_upstream(tree: Path, into: Path) -> Path:
    """A copy of the checkout's ``megatron`` and ``pretrain_gpt.py`` with ``SHIMS`` applied."""
    shutil.copytree(tree / "megatron", into / "megatron")
    shutil.copy(tree / "pretrain_gpt.py", into / "pretrain_gpt.py")
    for shim in SHIMS:
        path = into / shim.path
        text = path.read_text()
        if shim.old is None:
            path.write_text(text + shim.new)
            continue
        found = text.count(shim.old)
        if found == 0 or (shim.count is not None and found != shim.count):
            raise RuntimeError(f"{tree}: {shim.path} is not core_v0.11.0's ({shim.why}: "
                               f"expected {shim.count or 'some'} of {shim.old!r}, found {found})")
        path.write_text(text.replace(shim.old, shim.new))
    return into


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def flags(self) -> list[str]:
        return ["--tensor-model-parallel-size", str(self.tp),
                "--pipeline-model-parallel-size", str(self.pp)]


LAYOUTS = {layout.name: layout for layout in (
    Layout("dp1"), Layout("pp2", pp=2), Layout("tp2", tp=2), Layout("dp2", dp=2),
    Layout("pp2dp2", pp=2, dp=2))}
OPTIMIZERS = {"plain": [], "distributed": ["--use-distributed-optimizer"]}


@dataclass(frozen=True)
class Model:
    """The model and training flags both trees get (fp32, no dropout, fused kernels off)."""

    hidden: int = 64
    heads: int = 4
    seq: int = 64
    ffn: Optional[int] = None

    def flags(self) -> list[str]:
        ffn = ["--ffn-hidden-size", str(self.ffn)] if self.ffn else []
        return ["--transformer-impl", "local", "--num-layers", "2", "--hidden-size",
                str(self.hidden), "--num-attention-heads", str(self.heads), *ffn,
                "--seq-length", str(self.seq), "--max-position-embeddings", str(self.seq),
                "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
                "--micro-batch-size", "2", "--global-batch-size", "8",
                "--train-iters", str(TRAIN_ITERS), "--lr", "3e-3", "--lr-decay-style",
                "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--clip-grad",
                "1.0", "--adam-beta2", "0.95", "--log-interval", "1", "--eval-interval",
                "1000", "--eval-iters", "1", "--no-gradient-accumulation-fusion",
                "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
                "--no-bias-gelu-fusion", "--no-persist-layer-norm",
                # 128 rows at tp 1 and 2 alike: upstream resumes no other padded vocabulary size
                "--make-vocab-size-divisible-by", "64"]


class RunFailed(AssertionError):
    """A training run that did not end well; the message holds its ranks' last lines."""


@dataclass
class Runner:
    """Trains either tree at a layout on the corpus at ``corpus`` (a ``--data-path`` prefix)."""

    upstream: Path  # a ``prepare_upstream`` copy
    packages: list[Path]  # what upstream imports beyond this interpreter's site-packages
    corpus: Path
    model: Model
    extra: tuple[str, ...] = ()  # flags for every run (``--distributed-backend gloo``: CPU)

    def train(self, who: str, layout: Layout, extra: list[str], folder: Path) -> dict[int, float]:
        """The loss of every iteration run (collected in ``folder``: logs, data cache)."""
        script = (self.upstream if who == UPSTREAM else REPO) / "pretrain_gpt.py"
        path = [self.upstream, *self.packages] if who == UPSTREAM else [REPO]
        env = {"PYTHONPATH": os.pathsep.join(map(str, path)),
               **(UPSTREAM_ENV if who == UPSTREAM else {})}
        args = [*self.model.flags(), *data_flags(self.corpus, folder / "cache"), *layout.flags,
                *self.extra, *extra]
        launched = launch([sys.executable, str(script), *args], layout.ranks,
                          timeout_s=DEADLINE_S, log_dir=folder / "logs", extra_env=env)
        if not launched.ok:
            raise RunFailed(f"{who} at {layout.name} failed:\n{launched.describe()}")
        if who == UPSTREAM and UPSTREAM_MARK not in launched.combined:
            raise RunFailed(f"the run at {layout.name} was not upstream's: {launched.describe()}")
        return losses(launched.combined)

    def save(self, who: str, fmt: str, optimizer: str, layout: Layout,
             folder: Path) -> dict[int, float]:
        """Train to ``SAVE_AT`` and save there into ``folder / "checkpoint"``."""
        return self.train(who, layout, ["--ckpt-format", fmt, *OPTIMIZERS[optimizer],
                                        "--save", str(folder / "checkpoint"),
                                        "--save-interval", str(SAVE_AT),
                                        "--exit-interval", str(SAVE_AT)], folder)

    def resume(self, who: str, fmt: str, optimizer: str, layout: Layout, checkpoint: Path,
               folder: Path, no_load_rng: bool = False) -> dict[int, float]:
        """Resume ``checkpoint`` to ``TRAIN_ITERS``; the losses after the save."""
        rng = ["--no-load-rng"] if no_load_rng else []
        found = self.train(who, layout, ["--ckpt-format", fmt, *OPTIMIZERS[optimizer],
                                         "--load", str(checkpoint), *rng], folder)
        expected = list(range(SAVE_AT + 1, TRAIN_ITERS + 1))
        if sorted(found) != expected:
            raise RunFailed(f"{who} resumed {checkpoint} at {layout.name} with iterations "
                            f"{sorted(found)}, expected {expected}")
        return found


class RunCache:
    """Runs by name, done once per test session whatever the number of pytest-xdist workers:
    each run's folder and result under ``root``, made under a lock of its own. A failed run is
    recorded too, so the cells that need it fail at once with its message."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def once(self, name: str, produce: Callable[[Path], Any]) -> tuple[Path, Any]:
        """``produce(folder)``'s JSON-able result, made by the first caller only."""
        folder, result = self.root / name, self.root / f"{name}.json"
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not result.exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                try:
                    outcome = {"result": produce(folder)}
                except Exception as error:  # recorded for every cell that needs this run
                    outcome = {"error": "".join(traceback.format_exception_only(error))}
                result.write_text(json.dumps(outcome))
        outcome = json.loads(result.read_text())
        if "error" in outcome:
            raise RunFailed(f"{name} failed: {outcome['error']}")
        return folder, outcome["result"]

    def get(self, name: str, produce: Callable[[Path], dict[int, float]]
            ) -> tuple[Path, dict[int, float]]:
        """A run's folder and losses by iteration."""
        folder, found = self.once(name, produce)
        return folder, {int(k): v for k, v in found.items()}


def relative_difference(found: dict[int, float], expected: dict[int, float]) -> float:
    """The largest relative difference over the iterations of ``expected``."""
    return max(abs(found[i] - value) / abs(value) for i, value in expected.items())
