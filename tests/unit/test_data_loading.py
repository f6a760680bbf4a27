"""Collating variable-length samples: the padding rule, and that padding carries no loss."""

import types

import pytest
import torch

from megatron.training.data_loading import collate, pad_multiple


def sample(length: int) -> dict:
    tokens = torch.arange(1, length + 1)
    return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(length),
            "position_ids": torch.arange(length)}


@pytest.mark.parametrize("lengths,multiple,expected", [
    ([5, 9], 1, 9), ([5, 9], 8, 16), ([16], 8, 16),
    ([70], 64, 100),  # rounding would pass the sequence length: pad to it instead
    ([100], 64, 100),
])
def test_microbatch_length(lengths, multiple, expected):
    batch = collate([sample(n) for n in lengths], pad_id=0, multiple_of=multiple, max_length=100)
    assert batch["tokens"].shape == (len(lengths), expected)
    for row, length in enumerate(lengths):
        assert batch["loss_mask"][row].sum() == length
        assert torch.equal(batch["position_ids"][row], torch.arange(expected))
        assert (batch["tokens"][row, length:] == 0).all()


@pytest.mark.parametrize("multiple,tp,sp,cp,expected", [
    (1, 4, True, 1, 4), (64, 4, True, 1, 64), (64, 3, True, 1, 192), (64, 4, False, 1, 64),
    (1, 2, False, 1, 1),
    # Two chunks per context-parallel rank, each split again by sequence parallelism.
    (1, 1, False, 2, 4), (1, 2, True, 2, 4), (1, 3, True, 2, 12), (8, 4, False, 4, 8),
])
def test_pad_multiple_keeps_sequence_and_context_parallel_splittable(multiple, tp, sp, cp,
                                                                     expected):
    args = types.SimpleNamespace(variable_seq_length_multiple=multiple,
                                 tensor_model_parallel_size=tp, sequence_parallel=sp,
                                 context_parallel_size=cp)
    assert pad_multiple(args) == expected
