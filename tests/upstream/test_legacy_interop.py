"""Upstream megatron-core 0.11 reads this tree's ``--ckpt-format torch`` files, on its own code.

This tree saves each model of ``test_checkpoint_interop.MODELS`` (Llama-like, and GPT-2-like
with tied embeddings) with made-up Adam state through ``legacy_save`` (what ``--save
--ckpt-format torch`` runs), with the plain optimizer at tp 2 x pp 2 and with the distributed
optimizer at pp 2 x dp 2, in fp32 and in bf16 (fp32 main parameters). Upstream's ranks
(``upstream_checkpoint_rank.py``, action ``load_legacy``) then load the files as Megatron-LM's
``load_checkpoint`` does: a strict ``load_state_dict`` of its model, its optimizer's
``load_state_dict`` (and ``load_parameter_state`` of ``distrib_optim.pt``), the scheduler, the
rerun state machine (its enums unpickled from upstream's module path) and the RNG states; and
save again as Megatron-LM does. What upstream saved must be what went in, bit for bit: weights,
exp_avg, exp_avg_sq, fp32 main parameters, the step, the groups' learning rates and the
scheduler; so upstream read every tensor where this tree put it.

Upstream's code: ``MEGATRON_LM_TREE``, ``MEGATRON_CORE_WHEELS`` or the package registry, as in
``test_checkpoint_interop``; without any the tests skip.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatron.training.checkpoint.source import split_optimizer_key
from tests.launcher import run_ranks
from tests.upstream.test_checkpoint_interop import (  # noqa: F401 (fixture)
    MODELS, TOKENS, our_model, run_upstream, upstream_site,
)

pytestmark = pytest.mark.upstream

ITERATION, STEP, LR = 7, 5, 0.01
TOKENS_LEN = len(TOKENS[0])
LAYOUTS = {
    "plain": {"tp": 2, "pp": 2, "distributed_optimizer": False},
    "distributed": {"tp": 1, "pp": 2, "distributed_optimizer": True},
}


def _optimizer(model, distributed: bool, bf16: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    wrapped = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, min_lr=LR / 10, weight_decay=0.1, adam_beta2=0.95, bf16=bf16,
                        params_dtype=torch.bfloat16 if bf16 else torch.float32,
                        use_distributed_optimizer=distributed), [wrapped])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=LR / 10, lr_warmup_steps=1, lr_decay_steps=10,
        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=10,
        wd_incr_style="constant")
    for _ in range(STEP):
        scheduler.step(increment=1)
    return wrapped, optimizer, scheduler


def save_legacy_here(rank: int, world: int, out: str, layout: dict, bf16: bool) -> None:
    """Each model with made-up optimizer state, saved as ``--ckpt-format torch`` saves it."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.checkpoint.legacy_save import save_legacy

    tp, pp = layout["tp"], layout["pp"]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    for label, spec in MODELS.items():
        model = our_model(spec, tp, pp)
        if bf16:
            model = model.to(torch.bfloat16)
            model.config.bf16, model.config.params_dtype = True, torch.bfloat16
        wrapped, optimizer, scheduler = _optimizer(model, layout["distributed_optimizer"], bf16)
        optimizer.init_state_fn(optimizer.optimizer)
        torch.manual_seed(rank)
        for piece in optimizer.main_param_pieces():
            state = optimizer.optimizer.state[piece.main]
            state["exp_avg"].copy_(torch.randn_like(state["exp_avg"]))
            state["exp_avg_sq"].copy_(torch.rand_like(state["exp_avg_sq"]))
            state["step"].fill_(STEP)
            if bf16:
                piece.main.add_(1e-3 * torch.randn_like(piece.main))
        args = argparse.Namespace(
            **spec["args"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            data_parallel_size=world // (tp * pp), transformer_impl="local",
            no_save_optim=False, no_save_rng=False, decoupled_lr=None,
            data_parallel_random_init=False, overlap_grad_reduce=False, seq_length=TOKENS_LEN,
            kv_channels=None, vocab_size=spec["vocab"], padded_vocab_size=spec["vocab"],
            use_distributed_optimizer=layout["distributed_optimizer"], bf16=bf16, fp16=False)
        root = os.path.join(out, label, "torch")
        save_legacy(os.path.join(root, f"iter_{ITERATION:07d}"), ITERATION, [wrapped], optimizer,
                    scheduler, 96, args)
        if rank == 0:
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))


def _everything(path: str) -> tuple[dict, dict, list, dict]:
    from megatron.training.checkpoint.upstream_torch import TorchSource

    source = TorchSource(path)
    optimizer = source.read_optimizer(source.optimizer_shapes())
    groups = sorted((g["wd_mult"], g["lr"]) for g in source.param_group_settings)
    return source.read(source.shapes), optimizer, groups, source.scheduler_state


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_upstream_loads_our_legacy_files_exactly(upstream_site, tmp_path, kind, bf16):
    layout = LAYOUTS[kind]
    run_ranks(save_legacy_here, 4, args=(str(tmp_path / "ours"), layout, bf16), timeout_s=180)
    run_upstream(upstream_site, 4, {"action": "load_legacy", **layout, "bf16": bf16,
                                    "models": MODELS, "tokens": TOKENS,
                                    "load": str(tmp_path / "ours"),
                                    "out": str(tmp_path / "upstream")})
    for label in MODELS:
        ours = _everything(str(tmp_path / "ours" / label / "torch" / f"iter_{ITERATION:07d}"))
        again = _everything(str(tmp_path / "upstream" / label / "torch" /
                                f"iter_{ITERATION:07d}"))
        weights, optimizer, groups, scheduler = ours
        assert weights.keys() == again[0].keys() and optimizer.keys() == again[1].keys()
        assert [n for n in weights if not torch.equal(weights[n], again[0][n])] == [], label
        assert [k for k in optimizer if not torch.equal(optimizer[k], again[1][k])] == [], label
        assert {float(v) for k, v in optimizer.items()
                if split_optimizer_key(k)[0] == "step"} == {float(STEP)}
        assert ("fp32_param" in {split_optimizer_key(k)[0] for k in optimizer}) == bf16
        assert groups == again[2] and scheduler == again[3]
