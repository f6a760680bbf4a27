"""Training-side entry points (upstream megatron.training names)."""

from megatron.training.global_vars import get_args

__all__ = ["get_args"]
