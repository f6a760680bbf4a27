"""Training-side entry points (upstream megatron.training names)."""

from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.timers import get_timers

__all__ = ["get_args", "get_timers", "get_tokenizer"]
