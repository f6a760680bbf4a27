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


@pytest.mark.parametrize("multiple,tp,sp,expected", [
    (1, 4, True, 4), (64, 4, True, 64), (64, 3, True, 192), (64, 4, False, 64), (1, 2, False, 1),
])
def test_pad_multiple_keeps_sequence_parallel_splittable(multiple, tp, sp, expected):
    args = types.SimpleNamespace(variable_seq_length_multiple=multiple,
                                 tensor_model_parallel_size=tp, sequence_parallel=sp)
    assert pad_multiple(args) == expected
