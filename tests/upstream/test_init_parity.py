"""Same seed, same start: the initial GPT weights equal real upstream Megatron-LM's, bit for bit.

For each command line below (one rank, ``--use-cpu-initialization``, ``--transformer-impl
local``, fp32), upstream's own start-up and ``pretrain_gpt.model_provider`` build the model
from an upstream checkout (``MEGATRON_LM_TREE``, a core_v0.11.0 checkout holding ``megatron/``
and ``pretrain_gpt.py``; skipped when unset) in a process that sees only that tree
(``upstream_init_rank.py``), and this tree builds it through ``initialize_megatron`` and its
``pretrain_gpt.model_provider`` on a one-rank gloo group. Every tensor of the two state dicts
must be equal (same names, shapes, dtypes and values).

Upstream's argument parser imports packages this venv lacks: they come from a folder on the
upstream process's path only (see ``upstream_tree``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron.core.dist_checkpointing.upstream_names import to_local
from tests.launcher import run_ranks
from tests.upstream.upstream_harness import run_with_deadline, upstream_environment
from tests.upstream.upstream_tree import upstream_python_path

pytestmark = pytest.mark.upstream

RANK_SCRIPT = Path(__file__).with_name("upstream_init_rank.py")
DEADLINE_S = 300.0

# Flags both trees take; upstream's fusions are off (they need apex or Transformer Engine).
BASE = [
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
    "--no-bias-gelu-fusion", "--no-persist-layer-norm",
]
# One upstream start-up costs about half a minute here, so the features share a variant; a
# failure names every tensor that differs.
VARIANTS = {
    "defaults": [],  # learned positions, tied output, GeLU, biases, LayerNorm, multi-head
    "untied": ["--untie-embeddings-and-output-weights"],
    "llama-like": ["--seed", "77", "--init-method-std", "0.05", "--swiglu",
                   "--position-embedding-type", "rope", "--group-query-attention",
                   "--num-query-groups", "2", "--disable-bias-linear", "--normalization",
                   "RMSNorm", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96",
                   "--qk-layernorm", "--no-bias-swiglu-fusion", "--no-rope-fusion"],
    # Upstream 0.11 stops on this flag (its config has no field for the output projections'
    # initialiser); upstream_init_rank.py passes that initialiser the way upstream means.
    "xavier": ["--init-method-xavier-uniform", "--untie-embeddings-and-output-weights"],
}


@pytest.fixture(scope="module")
def upstream_path(tmp_path_factory) -> list[Path]:
    return upstream_python_path(tmp_path_factory.mktemp("upstream-packages"))


def upstream_state(python_path: list[Path], argv: list[str], out: Path,
                   tokens: list[list[int]] | None = None) -> dict:
    env = {**upstream_environment(python_path, world_size=1), "RANK": "0", "LOCAL_RANK": "0",
           # upstream's validate_args insists on it (it overlaps kernels with communication)
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    saved, log = out / "upstream.pt", out / "upstream.log"
    request = {"argv": argv, "out": str(saved), **({"tokens": tokens} if tokens else {})}
    command = [sys.executable, str(RANK_SCRIPT), json.dumps(request)]
    codes = run_with_deadline(command, [env], [log], give_up_at=time.monotonic() + DEADLINE_S)
    tail = "\n".join(log.read_text().splitlines()[-25:])
    assert codes == [0] and saved.exists(), f"upstream exit code {codes}:\n{tail}"
    return torch.load(saved, weights_only=True)


def save_our_state(rank: int, world_size: int, argv: list[str], out: str) -> None:
    """Rank-side: this tree's start-up and model provider, as ``pretrain_gpt.py`` runs them;
    the state dict goes to a file (tensors sent back through the pipe would outlive the rank)."""
    import pretrain_gpt
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model

    initialize_megatron(argv=argv)
    (model,) = get_model(pretrain_gpt.model_provider, wrap_with_ddp=False)
    torch.save({name: tensor for name, tensor in model.state_dict().items()
                if not name.endswith("_extra_state")}, out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_initial_weights_equal_upstream(variant, upstream_path, tmp_path):
    argv = BASE + VARIANTS[variant]
    theirs = {to_local(name): tensor
              for name, tensor in upstream_state(upstream_path, argv, tmp_path).items()}
    run_ranks(save_our_state, 1, args=(argv, str(tmp_path / "ours.pt")),
              init_process_group=False, timeout_s=180)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert sorted(ours) == sorted(theirs)
    unequal = [name for name, tensor in sorted(ours.items())
               if tensor.dtype != theirs[name].dtype or not torch.equal(tensor, theirs[name])]
    assert not unequal, f"{len(unequal)} of {len(ours)} tensors differ: {unequal}"
    # Every random draw was checked: the weights are not all constant.
    assert any(tensor.std() > 0 for tensor in ours.values())
