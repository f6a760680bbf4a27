"""Save and load strategies: ``torch`` for the common part (registered here, always
available) and ``torch_dist`` for the sharded part (registered on first use)."""

from megatron.core.dist_checkpointing.strategies.common import register_default_common_strategies

register_default_common_strategies()
