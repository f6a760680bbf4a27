"""Which global transformer layers each pipeline chunk holds.

Global layer order runs chunk-major: virtual chunk 0 of pipeline ranks 0..pp-1, then virtual
chunk 1 of ranks 0..pp-1, and so on (megatron-core's interleaved assignment). The split is
counted in *slots*: a pipeline rank holds ``slots / pp`` of them, or the sizes given by
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage`` with the rest
split evenly over the middle ranks, and each of its ``vpp`` chunks an equal share. A slot is a
transformer layer, except that ``account_for_embedding_in_pipeline_split`` makes the very first
slot the embedding and ``account_for_loss_in_pipeline_split`` the very last one the output layer
and loss, so that the first (last) chunk holds one layer fewer; such a chunk may hold none.

With 8 layers, pp=2, vpp=2: rank 0 holds [0, 1] and [4, 5], rank 1 holds [2, 3] and [6, 7].
With 6 layers, pp=4, vpp=2 and both slots counted: rank 0 holds [] (the embedding) and [3],
rank 3 holds [2] and [] (the loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from megatron.core import parallel_state


class LayerLayout(Protocol):
    """The fields of a TransformerConfig that decide where the layers go (which validates
    them with ``check_layer_split``, hence no import of it here)."""

    num_layers: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: Optional[int]
    num_layers_in_first_pipeline_stage: Optional[int]
    num_layers_in_last_pipeline_stage: Optional[int]
    account_for_embedding_in_pipeline_split: bool
    account_for_loss_in_pipeline_split: bool


@dataclass(frozen=True)
class PipelineStage:
    """The model chunk being built: pipeline rank/size and virtual (interleaved) rank/size."""

    rank: int = 0
    size: int = 1
    virtual_rank: Optional[int] = None
    virtual_size: Optional[int] = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"PipelineStage.rank={self.rank} must lie in [0, size={self.size})")
        if (self.virtual_rank is None) != (self.virtual_size is None):
            raise ValueError(
                "PipelineStage.virtual_rank and virtual_size must both be set or both be None, "
                f"got virtual_rank={self.virtual_rank}, virtual_size={self.virtual_size}"
            )
        if self.virtual_size is not None and not 0 <= self.virtual_rank < self.virtual_size:
            raise ValueError(
                f"PipelineStage.virtual_rank={self.virtual_rank} must lie in "
                f"[0, virtual_size={self.virtual_size})"
            )

    @property
    def is_first(self) -> bool:
        """Whether this chunk sees the embeddings (first rank, first virtual chunk)."""
        return self.rank == 0 and self.virtual_rank in (None, 0)

    @property
    def is_last(self) -> bool:
        """Whether this chunk computes the output (last rank, last virtual chunk)."""
        last_virtual = self.virtual_rank is None or self.virtual_rank == self.virtual_size - 1
        return self.rank == self.size - 1 and last_virtual


def _virtual_size(config: LayerLayout) -> int:
    return config.virtual_pipeline_model_parallel_size or 1


def _uneven(config: LayerLayout) -> bool:
    return (config.num_layers_in_first_pipeline_stage is not None
            or config.num_layers_in_last_pipeline_stage is not None)


def _extra_slots(config: LayerLayout) -> tuple[int, int]:
    """(1 if the embedding takes a slot else 0, likewise for the loss)."""
    return (int(config.account_for_embedding_in_pipeline_split),
            int(config.account_for_loss_in_pipeline_split))


def slots_per_pipeline_rank(config: LayerLayout) -> list[int]:
    """Slots held by each pipeline rank (all of its virtual chunks together)."""
    pp = config.pipeline_model_parallel_size
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if not _uneven(config):
        return [(config.num_layers + sum(_extra_slots(config))) // pp] * pp
    middle_ranks = pp - (first is not None) - (last is not None)
    middle_layers = config.num_layers - (first or 0) - (last or 0)
    per_middle = middle_layers // middle_ranks if middle_ranks else 0
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def _as_field(name: str, value) -> str:
    return f"{name}={value}"


def check_layer_split(config: LayerLayout, setting: Callable[[str, object], str] = _as_field
                      ) -> None:
    """Raise ValueError unless the layers split exactly over the chunks. ``setting(field,
    value)`` words each setting in the message (``--flag value`` for command lines)."""
    pp, vpp, total = config.pipeline_model_parallel_size, _virtual_size(config), config.num_layers
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    embedding, loss = _extra_slots(config)
    chunks = f"{setting('pipeline_model_parallel_size', pp)}"
    if vpp > 1:
        chunks += f" x {setting('virtual_pipeline_model_parallel_size', vpp)}"
    if not _uneven(config):
        slots = total + embedding + loss
        if slots % (pp * vpp):
            counted = ""
            if embedding or loss:
                counted = f" plus {embedding + loss} for the embedding/loss (= {slots} slots)"
            raise ValueError(
                f"{setting('num_layers', total)}{counted} does not divide evenly over {chunks} "
                f"= {pp * vpp} model chunks; choose a multiple of {pp * vpp}, or set "
                f"{setting('num_layers_in_first_pipeline_stage', 'N')} / "
                f"{setting('num_layers_in_last_pipeline_stage', 'N')}")
        return
    given = " and ".join(setting(name, value) for name, value in (
        ("num_layers_in_first_pipeline_stage", first),
        ("num_layers_in_last_pipeline_stage", last)) if value is not None)
    if embedding or loss:
        counted = " and ".join(setting(name, True) for name, value in (
            ("account_for_embedding_in_pipeline_split", embedding),
            ("account_for_loss_in_pipeline_split", loss)) if value)
        raise ValueError(f"{given} and {counted} are alternative ways to size the first and "
                         "last stages; use one")
    if pp < 2:
        raise ValueError(f"{given} needs {setting('pipeline_model_parallel_size', pp)} >= 2")
    for name, value in (("num_layers_in_first_pipeline_stage", first),
                        ("num_layers_in_last_pipeline_stage", last)):
        if value is not None and (value < 1 or value % vpp):
            raise ValueError(f"{setting(name, value)} must be >= 1 and a multiple of the "
                             f"virtual pipeline size {vpp}")
    middle_ranks = pp - (first is not None) - (last is not None)
    middle_layers = total - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_ranks == 0 and middle_layers != 0):
        raise ValueError(f"{given} leave {middle_layers} of {setting('num_layers', total)} "
                         f"for {middle_ranks} middle pipeline ranks (of "
                         f"{setting('pipeline_model_parallel_size', pp)})")
    if middle_ranks and middle_layers % (middle_ranks * vpp):
        raise ValueError(
            f"the {middle_layers} layers left for the {middle_ranks} middle pipeline ranks "
            f"({setting('num_layers', total)} minus {given}) do not divide evenly over them "
            f"x the virtual pipeline size {vpp}")


def layer_range(config: LayerLayout, stage: PipelineStage) -> range:
    """Global (0-based) indices of the layers held by ``stage``."""
    pp, vpp = config.pipeline_model_parallel_size, _virtual_size(config)
    if stage.size != pp or (stage.virtual_size or 1) != vpp:
        raise ValueError(
            f"pipeline stage {stage} does not match the config's pipeline_model_parallel_size="
            f"{pp} and virtual_pipeline_model_parallel_size="
            f"{config.virtual_pipeline_model_parallel_size}"
        )
    per_chunk = [slots // vpp for slots in slots_per_pipeline_rank(config)]
    chunk = stage.virtual_rank or 0
    first_slot = chunk * sum(per_chunk) + sum(per_chunk[: stage.rank])
    # Slot k holds layer k - 1 when slot 0 is the embedding; the loss slot holds no layer.
    shift = _extra_slots(config)[0]
    start = max(first_slot - shift, 0)
    end = min(first_slot + per_chunk[stage.rank] - shift, config.num_layers)
    return range(start, max(start, end))


def current_pipeline_stage(config: LayerLayout) -> PipelineStage:
    """The chunk being built on this rank, read from parallel_state as upstream model providers
    expect (``set_virtual_pipeline_model_parallel_rank(i)`` before building chunk ``i``)."""
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if pp == 1:
        return PipelineStage()
    try:
        rank = parallel_state.get_pipeline_model_parallel_rank()
        state_size = parallel_state.get_pipeline_model_parallel_world_size()
    except RuntimeError as err:
        raise RuntimeError(
            f"pipeline_model_parallel_size={pp}: cannot tell which stage to build because "
            "parallel_state is not initialised; initialise it, or pass "
            "pipeline_stage=PipelineStage(...) explicitly"
        ) from err
    if state_size != pp:
        raise ValueError(
            f"config.pipeline_model_parallel_size={pp} but parallel_state has {state_size} "
            "pipeline stages"
        )
    state_vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if (state_vpp or 1) != (vpp or 1):
        raise ValueError(
            f"config.virtual_pipeline_model_parallel_size={vpp} but parallel_state has "
            f"virtual pipeline size {state_vpp}"
        )
    if vpp is None:
        return PipelineStage(rank=rank, size=pp)
    virtual_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
    if virtual_rank is None:
        raise RuntimeError(
            "virtual_pipeline_model_parallel_size is set but parallel_state has no virtual "
            "rank; call parallel_state.set_virtual_pipeline_model_parallel_rank(i) before "
            "building model chunk i"
        )
    return PipelineStage(rank=rank, size=pp, virtual_rank=virtual_rank, virtual_size=vpp)


def get_transformer_layer_offset(config: LayerLayout) -> int:
    """Global index of the first layer of the chunk being built (megatron-core's name)."""
    return layer_range(config, current_pipeline_stage(config)).start


def get_num_layers_to_build(config: LayerLayout) -> int:
    """Number of layers in the chunk being built (megatron-core's name)."""
    return len(layer_range(config, current_pipeline_stage(config)))
