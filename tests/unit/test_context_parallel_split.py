"""The context-parallel split of a sequence (megatron/core/transformer/context_parallel.py):
every position on exactly one rank, two chunks each, the causal work balanced."""

import pytest
import torch

from megatron.core.transformer.context_parallel import chunk_positions, split_for_rank
from megatron.core.utils import get_batch_on_this_cp_rank


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_position_lands_on_one_rank_in_two_balanced_chunks(cp):
    length = 24 * cp
    held = [chunk_positions(length // cp, rank, cp) for rank in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(length))
    chunk = length // (2 * cp)
    for rank, positions in enumerate(held):
        assert positions.tolist() == [*range(rank * chunk, (rank + 1) * chunk),
                                      *range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]
        # Under a causal mask a row at position p sees p + 1 keys: the same total on every rank.
        assert int((positions + 1).sum()) == int((held[0] + 1).sum())


def test_split_takes_the_rows_of_its_positions_along_the_given_dimension():
    batch = torch.arange(2 * 16).view(2, 16)
    assert split_for_rank(batch, 1, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11],
                                                       [20, 21, 22, 23, 24, 25, 26, 27]]


def test_a_length_that_does_not_split_names_the_flag():
    with pytest.raises(ValueError, match="8 equal chunks for --context-parallel-size 4.*a multiple of 8"):
        split_for_rank(torch.zeros(1, 20), 1, 0, 4)


def test_without_context_parallelism_the_batch_is_untouched():
    batch = {"tokens": torch.zeros(2, 6), "attention_mask": torch.ones(2, 1, 6, 6)}
    assert get_batch_on_this_cp_rank(batch) is batch
