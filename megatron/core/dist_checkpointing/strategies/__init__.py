"""Save and load strategies, registered as the defaults here: ``torch`` for the common part
and ``torch_dist`` (on torch.distributed.checkpoint) for the sharded part."""

from megatron.core.dist_checkpointing.strategies.common import register_default_common_strategies
from megatron.core.dist_checkpointing.strategies.torch import register_default_torch_strategies

register_default_common_strategies()
register_default_torch_strategies()
