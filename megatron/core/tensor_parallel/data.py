"""``broadcast_data``: hand the tensor-parallel source rank's batch to the rest of its group.

Only the source (rank 0 of the tensor-parallel group) has to read data; the other ranks pass
``data=None`` if they like. Two broadcasts per call: a small table of shapes, then every
tensor flattened into one buffer, which the outputs are views of. The buffer lives where the
group's backend communicates: on the current GPU under NCCL, on the CPU otherwise (gloo).
"""

from __future__ import annotations

import math
from typing import Any, Hashable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.collectives import group_rank
from megatron.core.tensor_parallel.utils import resolve_tp_group

# Rows of the shape table: [number of dims, size 0, size 1, ...]; a row of -1 says that the
# source rejected that key, so the other ranks fail with it instead of waiting forever.
_MAX_DIMS = 8
_REJECTED = -1


def _device(group: Any) -> torch.device:
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _problem(tensor: torch.Tensor, datatype: torch.dtype) -> Optional[str]:
    if tensor.dtype != datatype:
        return f"has dtype {tensor.dtype}, not {datatype}"
    if tensor.dim() > _MAX_DIMS:
        return f"has {tensor.dim()} dimensions, more than the {_MAX_DIMS} supported"
    return None


def _broadcast_shapes(keys, data, datatype, source: bool, src: int, group: Any,
                      device: torch.device) -> list[tuple[int, ...]]:
    table = torch.zeros(len(keys), _MAX_DIMS + 1, dtype=torch.long)
    problems = {}
    if source:
        for row, key in enumerate(keys):
            tensor = data[key]
            problems[key] = _problem(tensor, datatype)
            if problems[key] is not None:
                table[row, 0] = _REJECTED
                continue
            table[row, 0] = tensor.dim()
            table[row, 1 : 1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.long)
    table = table.to(device)
    dist.broadcast(table, src, group=group)
    shapes = []
    for key, (ndim, *sizes) in zip(keys, table.tolist()):
        if ndim == _REJECTED:
            detail = problems.get(key) or "was rejected by the source rank"
            raise ValueError(f"broadcast_data: data[{key!r}] {detail}")
        shapes.append(tuple(sizes[:ndim]))
    return shapes


def broadcast_data(
    keys: Sequence[Hashable],
    data: Optional[Mapping[Hashable, torch.Tensor]],
    datatype: torch.dtype,
    *,
    tp_group: Any = None,
) -> dict[Hashable, torch.Tensor]:
    """``{key: data[key]}`` for ``keys``, as the tensor-parallel source rank holds them.

    Every tensor under ``keys`` must have dtype ``datatype`` (checked on the source; every
    rank then raises ValueError). ``tp_group`` (this tree's extension) defaults to
    parallel_state's tensor-parallel group; without torch.distributed the tensors are
    returned as they are.
    """
    group = resolve_tp_group(tp_group)
    source = group_rank(group) == 0
    if not keys:
        return {}
    if group is None:
        for key in keys:
            problem = _problem(data[key], datatype)
            if problem is not None:
                raise ValueError(f"broadcast_data: data[{key!r}] {problem}")
        return {key: data[key] for key in keys}

    device = _device(group)
    src = dist.get_global_rank(group, 0)
    shapes = _broadcast_shapes(keys, data, datatype, source, src, group, device)
    numels = [math.prod(shape) for shape in shapes]
    if source:
        flat = torch.cat([data[key].reshape(-1).to(device) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)
    pieces = flat.split(numels)
    return {key: piece.view(shape) for key, piece, shape in zip(keys, pieces, shapes)}
