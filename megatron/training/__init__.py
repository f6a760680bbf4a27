"""Training-side entry points (upstream megatron.training names)."""

from megatron.training.global_vars import get_args, get_tokenizer

__all__ = ["get_args", "get_tokenizer"]
