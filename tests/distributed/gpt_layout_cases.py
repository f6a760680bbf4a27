"""Rank-side code: train a small GPT for a few steps on one tp x pp x dp layout, and compare
every loss, gradient norm and final parameter with the same training in one process.

The reference is the full model on a one-rank group, built from the same seed (the initial
weights do not depend on the layout), fed the same global batches, reduced and stepped by the
same DDP and optimizer code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
from tests.support.gpt_support import VOCAB, build_gpt, small_config, unshard

SEQ, MBS, GLOBAL_BATCH, STEPS = 12, 2, 8, 3


def _global_batches():
    gen = torch.Generator().manual_seed(2024)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]


def _loss_func(output):
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    positions = torch.arange(SEQ)[None].expand(MBS, SEQ)
    return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]), _loss_func


def _optimizer(chunks, distributed: bool, **groups):
    config = OptimizerConfig(lr=0.01, weight_decay=0.1, clip_grad=0.5,
                             use_distributed_optimizer=distributed)
    return get_megatron_optimizer(config, chunks, **groups)


def _train(chunks, optimizer, microbatches_per_step, schedule):
    """STEPS optimizer steps; returns per-step (mean loss or None, grad norm)."""
    history = []
    for step_batches in microbatches_per_step:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        interleaved = len(chunks) > 1
        iterators = [iter(step_batches) for _ in chunks]
        reported = schedule(
            forward_step_func=_forward_step,
            data_iterator=iterators if interleaved else iterators[0],
            model=chunks if interleaved else chunks[0],
            num_microbatches=len(step_batches), seq_length=SEQ, micro_batch_size=MBS)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        loss = (sum(float(r["lm loss"]) for r in reported) / len(reported)) if reported else None
        history.append((loss, float(grad_norm)))
    return history


def _layout_chunks(tp, pp, vpp):
    chunks = []
    for chunk in range(vpp or 1):
        if vpp:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        # The layouts' weight gradients go straight into main_grad (written by the first
        # microbatch after zero_grad_buffer, added by the others); the reference's through
        # autograd and the buffer's hook.
        config = small_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              virtual_pipeline_model_parallel_size=vpp,
                              sequence_parallel=tp > 1, pipeline_dtype=torch.float32,
                              add_bias_linear=False, gradient_accumulation_fusion=True)
        chunks.append(build_gpt(config, pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage(),
                                share_embeddings_and_output_weights=True))
    return chunks


def _wrap(chunks, distributed: bool, **groups):
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0, **groups)
               for i, c in enumerate(chunks)]
    for chunk in wrapped:
        chunk.config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 \
            else wrapped[0].no_sync
        chunk.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def _global_name(chunk, name: str) -> str:
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        parts[2] = str(chunk.decoder.global_layer_indices[int(parts[2])])
        return ".".join(parts)
    if name == "output_layer.weight" and chunk.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied weight
    return name


def train_layout(rank: int, tp: int, pp: int, dp: int, vpp, distributed: bool, solo_group):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp)
    try:
        dp_rank = parallel_state.get_data_parallel_rank()
        chunks = _wrap(_layout_chunks(tp, pp, vpp), distributed)
        optimizer = _optimizer(chunks, distributed)
        per_rank = GLOBAL_BATCH // dp
        mine = [[batch[dp_rank * MBS + k * MBS * dp: dp_rank * MBS + k * MBS * dp + MBS]
                 for k in range(per_rank // MBS)] for batch in _global_batches()]
        history = _train(chunks, optimizer, mine, get_forward_backward_func())

        reference = build_gpt(small_config(add_bias_linear=False), tp_group=solo_group,
                              share_embeddings_and_output_weights=True)
        ref_chunks = _wrap([reference], False, data_parallel_group=solo_group)
        ref_optimizer = _optimizer(ref_chunks, False, model_parallel_group=solo_group,
                                   tensor_parallel_group=solo_group)
        everything = [[batch[k * MBS:(k + 1) * MBS] for k in range(GLOBAL_BATCH // MBS)]
                      for batch in _global_batches()]
        expected = _train(ref_chunks, ref_optimizer, everything, forward_backward_no_pipelining)

        worst = {"trajectory": 0.0, "parameters": 0.0}
        for (loss, norm), (ref_loss, ref_norm) in zip(history, expected):
            worst["trajectory"] = max(worst["trajectory"], abs(norm - ref_norm) / ref_norm)
            if loss is not None:
                # Each data-parallel rank reports the loss of its own share of the batch.
                total = torch.tensor([loss])
                dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
                worst["trajectory"] = max(worst["trajectory"],
                                          abs(float(total) / dp - ref_loss) / ref_loss)
        ref_params = dict(reference.named_parameters())
        # Adam turns rounding noise in near-zero gradients (keys' share of the QKV weight: the
        # softmax ignores a shift of all keys) into updates of up to lr, so final parameters
        # get a looser bound than the loss and gradient-norm trajectory.
        tp_group = parallel_state.get_tensor_model_parallel_group()
        for chunk in chunks:
            for name, param in chunk.module.named_parameters():
                full = unshard(param.detach(), param, tp_group)
                want = ref_params[_global_name(chunk.module, name)].detach()
                worst["parameters"] = max(worst["parameters"],
                                          float((full - want).abs().max() / want.abs().max()))
        return worst
    finally:
        parallel_state.destroy_model_parallel()


LAYOUTS = {  # world size -> (tp, pp, dp, vpp)
    1: [(1, 1, 1, None)],
    2: [(2, 1, 1, None), (1, 2, 1, None), (1, 2, 1, 2), (1, 1, 2, None)],
    4: [(2, 2, 1, None), (1, 2, 2, None), (2, 1, 2, None)],
}


def run_layouts(rank: int, world_size: int) -> dict:
    solo_groups = [dist.new_group([r]) for r in range(world_size)]
    results = {}
    for tp, pp, dp, vpp in LAYOUTS[world_size]:
        for distributed in ((False, True) if dp > 1 else (False,)):
            key = f"tp{tp} pp{pp} dp{dp}" + (f" vpp{vpp}" if vpp else "") + \
                (" distributed-optimizer" if distributed else "")
            results[key] = train_layout(rank, tp, pp, dp, vpp, distributed, solo_groups[rank])
    return results

