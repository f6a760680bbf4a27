"""Sharded (distributed) checkpoints with megatron-core 0.11's API and on-disk format.

Wrap a state dict's tensors as ``ShardedTensor`` (and per-rank objects as ``ShardedObject``),
then ``save`` it collectively; ``load`` takes a sharded state dict of the layout to load into,
whatever layout saved it. The ``torch_dist`` backend (torch.distributed.checkpoint) is written
and read; every file is read without unpickling anything but the tensors, containers and few
classes checkpoints hold (``safe_load``).
"""

from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
)
from megatron.core.dist_checkpointing.serialization import (
    load,
    load_common_state_dict,
    load_plain_tensors,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)

__all__ = ["LocalNonpersistentObject", "ShardedObject", "ShardedTensor",
           "check_is_distributed_checkpoint", "load", "load_common_state_dict",
           "load_plain_tensors", "load_tensors_metadata", "remove_sharded_tensors", "save"]
