"""Enumerations of the transformer package (member names and values as in megatron-core 0.11).

``ModelType`` is the same class as :class:`megatron.core.enums.ModelType`, so a model's
``model_type`` compares equal whichever module the schedules import it from.
"""

import enum

from megatron.core.enums import ModelType

__all__ = ["AttnBackend", "AttnMaskType", "AttnType", "LayerType", "ModelType"]


class LayerType(enum.Enum):
    """Where a transformer layer sits in an encoder/decoder model."""

    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    """Whether attention looks at its own sequence or at another one."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """Which positions a query may not look at."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


class AttnBackend(enum.Enum):
    """Attention kernel family; only Transformer Engine distinguishes flash/fused/unfused."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5
