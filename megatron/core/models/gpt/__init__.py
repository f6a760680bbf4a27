"""GPT models (megatron-core 0.11 import path: ``from megatron.core.models.gpt import GPTModel``)."""

from megatron.core.models.gpt.gpt_model import GPTModel

__all__ = ["GPTModel"]
