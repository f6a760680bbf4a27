"""The flag groups in upstream's --help order (see ``schema`` for how a field becomes a flag)."""

from megatron.training.flags.checkpointing import CheckpointingArgs
from megatron.training.flags.data import DataArgs
from megatron.training.flags.logging import LoggingArgs
from megatron.training.flags.model import (
    ExperimentalArgs, InitializationArgs, MixedPrecisionArgs, NetworkSizeArgs, RegularizationArgs,
    TransformerEngineArgs,
)
from megatron.training.flags.parallel import DistributedArgs
from megatron.training.flags.training import LearningRateArgs, TrainingArgs, ValidationArgs
from megatron.training.flags.unavailable import (
    BiencoderArgs, InferenceArgs, MLAArgs, ModelOptArgs, MoEArgs, RetroArgs, ServicesArgs,
    VisionArgs,
)
from megatron.training.tokenizer.tokenizer_args import TokenizerArgs

ARGUMENT_GROUPS: tuple[tuple[str, type], ...] = (
    ("network size", NetworkSizeArgs),
    ("regularization", RegularizationArgs),
    ("training", TrainingArgs),
    ("initialization", InitializationArgs),
    ("learning rate", LearningRateArgs),
    ("checkpointing", CheckpointingArgs),
    ("mixed precision", MixedPrecisionArgs),
    ("distributed", DistributedArgs),
    ("validation", ValidationArgs),
    ("data and dataloader", DataArgs),
    ("tokenizer", TokenizerArgs),  # declared next to the tokenizers, shared with preprocess_data
    ("logging", LoggingArgs),
    ("transformer engine", TransformerEngineArgs),
    ("experimental", ExperimentalArgs),
    ("mixture of experts (not available)", MoEArgs),
    ("multi-latent attention (not available)", MLAArgs),
    ("biencoder (not available)", BiencoderArgs),
    ("vision (not available)", VisionArgs),
    ("retro (not available)", RetroArgs),
    ("inference (not available)", InferenceArgs),
    ("NVIDIA services", ServicesArgs),
    ("ModelOpt (not available)", ModelOptArgs),
)

__all__ = ["ARGUMENT_GROUPS"] + [cls.__name__ for _, cls in ARGUMENT_GROUPS]
