"""Megatron-LM compatible GPT pretraining (megatron-safepipe)."""
