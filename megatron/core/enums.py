"""Enumerations shared across megatron.core (values match megatron-core 0.11)."""

import enum


class ModelType(enum.Enum):
    """How a model's layers divide into encoder and decoder parts for pipelining."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4
