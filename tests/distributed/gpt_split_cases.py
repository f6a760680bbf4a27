"""Rank-side code: one training step of a small GPT under uneven pipeline splits and deferred
output-layer weight gradients, compared with the same step in one process.

Each case builds this rank's chunks of a tp x pp x dp (x vpp) layout with a layer split
(``num_layers_in_first/last_pipeline_stage``, ``account_for_embedding/loss_in_pipeline_split``)
and optionally ``defer_embedding_wgrad_compute``, runs one forward-backward through
``get_forward_backward_func()`` with ``finalize_model_grads``, and returns the largest relative
difference of any reported loss and of any gradient (as the optimizer would read it) from the
full model trained on the whole global batch in one process. Deferral cases also return the
difference from the same layout without deferral.

``device="cuda"`` runs chunks, data and reference on the GPU (the NCCL matrix in tests/gpu).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from tests.support.gpt_support import VOCAB, build_gpt, small_config, unshard

SEQ, MBS = 8, 2


@dataclasses.dataclass(frozen=True)
class SplitCase:
    pp: int
    num_layers: int
    vpp: Optional[int] = None
    first: Optional[int] = None
    last: Optional[int] = None
    embedding: bool = False
    loss: bool = False
    defer_limit: Optional[int] = None  # None: no deferral
    tp: int = 1
    dp: int = 1
    overlap_grad_reduce: bool = False
    tied: bool = True
    microbatches: int = 8  # of the global batch, over all data-parallel ranks

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def __str__(self):
        parts = [f"L={self.num_layers} tp{self.tp} pp{self.pp} dp{self.dp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp else []
        parts += [f"first={self.first}"] if self.first is not None else []
        parts += [f"last={self.last}"] if self.last is not None else []
        parts += ["+embedding"] if self.embedding else []
        parts += ["+loss"] if self.loss else []
        parts += [f"defer(limit={self.defer_limit})"] if self.defer_limit is not None else []
        parts += ["overlap-grad-reduce"] if self.overlap_grad_reduce else []
        parts += [] if self.tied else ["untied"]
        return " ".join(parts + [f"m={self.microbatches}"])


def _batches(case: SplitCase, device):
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (case.microbatches * MBS, SEQ + 1), generator=gen)
    return list(tokens.to(device).split(MBS))


def _loss_func(output):
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    positions = torch.arange(SEQ, device=tokens.device)[None].expand(MBS, SEQ)
    return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]), _loss_func


def _reference_config(case: SplitCase):
    return small_config(num_layers=case.num_layers, add_bias_linear=False)


def _config(case: SplitCase, defer: bool):
    return small_config(
        num_layers=case.num_layers, add_bias_linear=False, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=case.tp, sequence_parallel=case.tp > 1,
        pipeline_model_parallel_size=case.pp, virtual_pipeline_model_parallel_size=case.vpp,
        num_layers_in_first_pipeline_stage=case.first,
        num_layers_in_last_pipeline_stage=case.last,
        account_for_embedding_in_pipeline_split=case.embedding,
        account_for_loss_in_pipeline_split=case.loss,
        defer_embedding_wgrad_compute=defer, wgrad_deferral_limit=case.defer_limit or 0,
        deallocate_pipeline_outputs=True)  # as the trainer runs


def _wrap(chunks, case: SplitCase, finalize, **groups):
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=case.overlap_grad_reduce)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0, **groups)
               for i, c in enumerate(chunks)]
    for chunk in wrapped:
        chunk.config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 \
            else wrapped[0].no_sync
        chunk.config.finalize_model_grads_func = finalize
    return wrapped


def _step(chunks, microbatches, schedule) -> list[float]:
    """One forward-backward; returns the reported losses (last stage only)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    interleaved = len(chunks) > 1
    iterators = [iter(microbatches) for _ in chunks]
    reported = schedule(forward_step_func=_forward_step,
                        data_iterator=iterators if interleaved else iterators[0],
                        model=chunks if interleaved else chunks[0],
                        num_microbatches=len(microbatches), seq_length=SEQ, micro_batch_size=MBS)
    return [float(r["lm loss"]) for r in reported]


def _pipelined(case: SplitCase, defer: bool, microbatches, device):
    chunks = []
    for v in range(case.vpp or 1):
        if case.vpp:
            parallel_state.set_virtual_pipeline_model_parallel_rank(v)
        config = _config(case, defer)
        chunks.append(build_gpt(config, pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage(),
                                share_embeddings_and_output_weights=case.tied).to(device))
    chunks = _wrap(chunks, case, finalize_model_grads)
    losses = _step(chunks, microbatches, get_forward_backward_func())
    return chunks, losses


def _global_name(model, name: str) -> str:
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        parts[2] = str(model.decoder.global_layer_indices[int(parts[2])])
        return ".".join(parts)
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
    return name


def _full_grads(chunks) -> list[tuple[str, torch.Tensor]]:
    """(name in the full model, whole gradient) of every parameter of this rank's chunks."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    return [(_global_name(chunk.module, name), unshard(param.main_grad, param, tp_group))
            for chunk in chunks for name, param in chunk.module.named_parameters()]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)


def _reference(case: SplitCase, batches, solo, device):
    model = build_gpt(_reference_config(case), tp_group=solo,
                      share_embeddings_and_output_weights=case.tied).to(device)
    finalize = functools.partial(finalize_model_grads, tp_group=solo, pp_group=solo,
                                 dp_group=solo, embedding_group=solo)
    [wrapped] = _wrap([model], case, finalize, data_parallel_group=solo)
    losses = _step([wrapped], batches, forward_backward_no_pipelining)
    return losses, {name: p.main_grad for name, p in model.named_parameters()}


def run_case(case: SplitCase, solo, device) -> dict:
    dp, dp_rank = case.dp, parallel_state.get_data_parallel_rank()
    batches = _batches(case, device)
    mine = batches[dp_rank::dp]  # microbatch k of this rank is global microbatch k * dp + dp_rank
    ref_losses, ref_grads = _reference(case, batches, solo, device)
    chunks, losses = _pipelined(case, case.defer_limit is not None, mine, device)
    result = {"case": str(case), "loss": 0.0, "grad": 0.0}
    for got, want in zip(losses, ref_losses[dp_rank::dp]):
        result["loss"] = max(result["loss"], abs(got - want) / abs(want))
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        assert len(losses) == len(mine), (len(losses), case)
    grads = _full_grads(chunks)
    for name, grad in grads:
        result["grad"] = max(result["grad"], _relative(grad, ref_grads[name]))
    if case.defer_limit is not None:
        plain = _full_grads(_pipelined(case, False, mine, device)[0])
        result["deferral"] = max(_relative(grad, plain_grad)
                                 for (_, grad), (_, plain_grad) in zip(grads, plain))
    return result


def run_split_cases(rank: int, world_size: int, cases: list[SplitCase], device="cpu") -> list:
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("highest")  # both sides in full fp32
    solo_groups = [dist.new_group([r]) for r in range(world_size)]
    results = []
    for case in cases:
        assert case.world_size == world_size, (case, world_size)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=case.tp, pipeline_model_parallel_size=case.pp,
            virtual_pipeline_model_parallel_size=case.vpp)
        try:
            results.append(run_case(case, solo_groups[rank], device))
        finally:
            parallel_state.destroy_model_parallel()
    return results


CASES = {  # world size -> cases
    2: [
        SplitCase(pp=2, num_layers=5, first=2),
        SplitCase(pp=2, num_layers=5, last=1, tied=False),
        SplitCase(pp=2, num_layers=6, embedding=True, loss=True),
        SplitCase(pp=2, num_layers=6, vpp=2, embedding=True, loss=True),
        SplitCase(pp=2, num_layers=2, vpp=2, embedding=True, loss=True),  # empty end chunks
        SplitCase(pp=2, num_layers=6, vpp=2, first=2, last=4),
        SplitCase(pp=2, num_layers=6, vpp=2, last=2),  # upstream numbers these layers wrongly
        SplitCase(pp=2, num_layers=4, defer_limit=0),
        SplitCase(pp=2, num_layers=4, defer_limit=3, tied=False),
        SplitCase(pp=2, num_layers=6, vpp=2, embedding=True, loss=True, defer_limit=0),
    ],
    3: [
        SplitCase(pp=3, num_layers=4, first=2, last=2),  # a middle rank without layers
        SplitCase(pp=3, num_layers=5, vpp=2, embedding=True, defer_limit=2, microbatches=6),
    ],
    4: [
        SplitCase(pp=4, num_layers=12, first=2, last=2),  # upstream's CI uneven layout
        SplitCase(pp=4, num_layers=6, vpp=2, embedding=True, loss=True),  # upstream's CI
        SplitCase(pp=2, num_layers=4, tp=2, defer_limit=2, overlap_grad_reduce=True),
        SplitCase(pp=2, num_layers=6, dp=2, embedding=True, loss=True, defer_limit=0,
                  overlap_grad_reduce=True),
    ],
}
