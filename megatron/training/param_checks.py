"""Whole-model checks on the parameters: their L2 norm (``--log-params-norm``) and whether the
data-parallel replicas still hold identical weights
(``--check-weight-hash-across-dp-replicas-interval``).

The norm counts every parameter once over the model-parallel ranks: a tensor-parallel
replicated tensor on TP rank 0 only, the last stage's copy of a tied embedding (``shared``)
not at all. With bf16 it reads the optimizer's fp32 main parameters, as upstream does; the
distributed optimizer keeps them sharded over data parallelism, so their squares are summed
over the data-parallel group first.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.optimizer.param_attributes import param_is_not_shared
from megatron.core.tensor_parallel.param_attributes import param_is_not_tensor_parallel_duplicate
from megatron.core.utils import collective_device


class WeightHashMismatch(RuntimeError):
    """Data-parallel replicas hold different weights; the message names the ranks.
    ``reporter`` is True on the one rank that should print it."""

    def __init__(self, message: str, reporter: bool):
        super().__init__(message)
        self.reporter = reporter


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squared entries, accumulated in fp32 whatever the tensors' dtype."""
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(t.detach(), dtype=torch.float32).to(device)
                         for t in tensors])
    return torch.sum(norms * norms).view(1)


def calc_params_l2_norm(model, force_create_fp32_copy: bool = False) -> float:
    """The L2 norm of all of the model's parameters (a collective on every rank)."""
    if not isinstance(model, list):
        model = [model]
    use_main = not force_create_fp32_copy and any(
        param.dtype == torch.bfloat16 for chunk in model for param in chunk.parameters())
    replicated, sharded, any_sharded = [], [], False
    for chunk in model:
        for param in chunk.parameters():
            if not (param_is_not_tensor_parallel_duplicate(param) and param_is_not_shared(param)):
                continue
            if not (use_main and hasattr(param, "main_param")):
                replicated.append(param)
            elif getattr(param, "main_param_sharded", False):
                any_sharded = True
                if param.main_param is not None:  # None: another data-parallel rank owns it
                    sharded.append(param.main_param)
            else:
                replicated.append(param.main_param)
    device = collective_device(parallel_state.get_model_parallel_group())
    norm_2 = _sum_of_squares(replicated, device)
    if any_sharded:  # the same on every data-parallel replica, so all of them join
        pieces = _sum_of_squares(sharded, device)
        dist.all_reduce(pieces, group=parallel_state.get_data_parallel_group(
            with_context_parallel=True))
        norm_2 += pieces
    dist.all_reduce(norm_2, group=parallel_state.get_model_parallel_group())
    return norm_2.item() ** 0.5


def _param_hashes(model: list) -> tuple[list[str], torch.Tensor]:
    """Names and SHA-1 digests (one row of 20 bytes each) of this rank's parameters."""
    names, digests = [], []
    for index, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            data = param.detach().float().cpu().numpy()
            names.append(f"model chunk {index}: {name}")
            digests.append(torch.frombuffer(bytearray(hashlib.sha1(data.tobytes()).digest()),
                                            dtype=torch.uint8))
    return names, torch.stack(digests)


def check_weights_agree_across_dp_replicas(model: list, iteration: int) -> None:
    """Compare every parameter's hash with the data-parallel rank 0's. If any rank differs,
    raise ``WeightHashMismatch`` on every rank (all stop at the same iteration), naming the
    ranks; else print upstream's confirmation line. A collective of all ranks."""
    names, local = _param_hashes(model)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    device = collective_device(group)
    gathered = [torch.empty_like(local, device=device)
                for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local.to(device), group=group)
    reference = gathered[0].cpu()
    differs = [i for i in range(len(names)) if not torch.equal(local[i], reference[i])]
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[dist.get_rank()] = 1 if differs else 0
    dist.all_reduce(flags)
    bad = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if bad:
        reporter = dist.get_rank() == bad[0]
        detail = f" (first differing parameter on rank {bad[0]}: {names[differs[0]]})" \
            if reporter else ""
        raise WeightHashMismatch(
            f"--check-weight-hash-across-dp-replicas-interval: after {iteration} iterations the "
            f"weights of rank(s) {', '.join(map(str, bad))} differ from those of their "
            f"data-parallel rank 0{detail}", reporter=reporter)
    if dist.get_rank() == 0:
        print(f">>> Weight hashes match after {iteration} iterations...", flush=True)
