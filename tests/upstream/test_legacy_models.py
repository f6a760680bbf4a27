"""Upstream's legacy GPT (``--use-legacy-models``) is this tree's GPT under other names.

Upstream's own start-up and ``pretrain_gpt.model_provider`` build its legacy GPT
(``megatron.legacy.model.GPTModel``) from an upstream checkout (``MEGATRON_LM_TREE``, skipped
when unset; ``upstream_init_rank.py``, with its shims for apex's LayerNorm on a CPU), and this
tree builds its GPT from the same command line. Every legacy tensor, renamed by
``legacy_model_names.to_canonical``, has this tree's shape and dtype, and equals this tree's
initial tensor bit for bit but for the attention's two weight matrices: from the same seed the
legacy GPT draws the query-key-value weight before the output projection's, megatron-core (and
this tree, which starts where megatron-core starts) the other way round. Loaded with the legacy
weights, this tree's GPT gives the legacy GPT's logits on the same tokens (fp32, one rank): the
names, the query-key-value layout and the computation are the same.

And a checkpoint upstream's own ``save_checkpoint`` wrote of its legacy GPT (``--ckpt-format
torch``) resumes here with ``--load``: at the saved iteration, with the saved model's logits.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.dist_checkpointing import legacy_model_names
from tests.launcher import run_ranks
from tests.upstream.test_init_parity import (  # noqa: F401 (fixture)
    BASE, upstream_path, upstream_state,
)

pytestmark = pytest.mark.upstream

TOKENS = [[(7 * i + 3 * row) % 1000 for i in range(32)] for row in range(2)]
VARIANTS = {
    "tied": [],
    "untied": ["--untie-embeddings-and-output-weights", "--seed", "5"],
}


def our_state_and_logits(rank: int, world_size: int, argv: list[str], out: str,
                         load: str) -> None:
    """Rank-side: this tree's start-up and model provider; its initial state dict, then the
    logits on ``TOKENS`` (causal mask) with the weights of ``load`` (canonical names), go to a
    file."""
    import pretrain_gpt
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import get_model

    initialize_megatron(argv=argv)
    (model,) = get_model(pretrain_gpt.model_provider, wrap_with_ddp=False)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()
             if not name.endswith("_extra_state")}
    if load.endswith(".pt"):
        model.load_state_dict(torch.load(load, weights_only=True), strict=False)
    else:
        from megatron.training.checkpointing import load_checkpoint

        state["iteration"] = torch.tensor(load_checkpoint([model], None, None)[0])
    ids = torch.tensor(TOKENS)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)[None, None]
    model.eval()
    with torch.no_grad():
        state["logits"] = model(ids, positions, causal).float()
    torch.save(state, out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_legacy_gpt_has_this_trees_weights_and_logits(variant, upstream_path, tmp_path):
    argv = BASE + VARIANTS[variant]
    theirs = upstream_state(upstream_path, argv + ["--use-legacy-models", "--ckpt-format",
                                                   "torch"], tmp_path, TOKENS)
    their_logits = theirs.pop("logits")
    renamed = {legacy_model_names.to_canonical(name): tensor for name, tensor in theirs.items()}
    assert len(renamed) == len(theirs)
    torch.save(renamed, tmp_path / "legacy.pt")
    run_ranks(our_state_and_logits, 1,
              args=(argv, str(tmp_path / "ours.pt"), str(tmp_path / "legacy.pt")),
              init_process_group=False, timeout_s=180)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    our_logits = ours.pop("logits")

    assert sorted(renamed) == sorted(ours)
    assert all(ours[name].shape == renamed[name].shape and ours[name].dtype == renamed[name].dtype
               for name in ours)
    unequal = [name for name, tensor in sorted(ours.items()) if not torch.equal(tensor,
                                                                                renamed[name])]
    drawn_in_another_order = [name for name in ours if name.endswith((
        "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"))]
    assert sorted(unequal) == sorted(drawn_in_another_order)
    assert all(legacy_model_names.to_legacy(canonical) == legacy
               for legacy, canonical in zip(theirs, map(legacy_model_names.to_canonical, theirs)))
    assert our_logits.shape == their_logits.shape
    torch.testing.assert_close(our_logits, their_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_legacy_gpt_checkpoint_upstream_saved_resumes_here(variant, upstream_path, tmp_path):
    argv = BASE + VARIANTS[variant]
    saved = tmp_path / "checkpoint"
    theirs = upstream_state(upstream_path, argv + [
        "--use-legacy-models", "--ckpt-format", "torch", "--save", str(saved),
        "--save-interval", "3", "--no-save-optim", "--no-save-rng"], tmp_path, TOKENS)
    run_ranks(our_state_and_logits, 1,
              args=(argv + ["--load", str(saved), "--no-load-optim", "--no-load-rng"],
                    str(tmp_path / "ours.pt"), str(saved)),
              init_process_group=False, timeout_s=180)
    ours = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert int(ours["iteration"]) == 3
    torch.testing.assert_close(ours["logits"], theirs["logits"], rtol=1e-5, atol=1e-5)
