"""Start-up decisions that need no processes: device binding and disagreement messages."""

import datetime

import pytest
import torch

from megatron.training.initialize import init_process_group_kwargs
from megatron.training.rendezvous import describe_disagreement, format_ranks

VERSIONS = ["2.3.1", "2.4.0a0+f70bd71a48", "2.4.0", "2.4.1", "2.5.1", "2.9.0a0+50eac811a6",
            "2.10.0", "2.11.0", "2.13.0"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_init_process_group_never_binds_a_device(monkeypatch, version, backend):
    """The decision table: every torch version and backend gets exactly these arguments.

    Binding (``device_id``) plus lazily created member groups is the start-up hang of
    upstream #1027; this tree never binds, whatever the version string says.
    """
    monkeypatch.setattr(torch, "__version__", version)
    store, timeout = object(), datetime.timedelta(minutes=10)
    kwargs = init_process_group_kwargs(backend=backend, store=store, rank=3, world_size=8,
                                       timeout=timeout)
    assert kwargs == {"backend": backend, "store": store, "rank": 3, "world_size": 8,
                      "timeout": timeout}


def test_disagreement_names_first_differing_item_and_both_sides():
    versions = {
        (0, 2): [["--tensor-model-parallel-size", 1], ["--pipeline-model-parallel-size", 2],
                 ["--seed", 1]],
        (1,): [["--tensor-model-parallel-size", 1], ["--pipeline-model-parallel-size", 4],
               ["--seed", 2]],
    }
    message = describe_disagreement("arguments", versions)
    assert message.startswith("ranks disagree on their arguments at "
                              "--pipeline-model-parallel-size: 2 on rank(s) [0, 2]; "
                              "4 on rank(s) [1].")


def test_disagreement_shows_names_when_items_differ_in_kind():
    versions = {(0,): [["process group #0", ["dp", [0], None]]],
                (1,): [["torch version", "2.4.0"]]}
    message = describe_disagreement("groups", versions)
    assert 'process group #0 = ["dp", [0], null] on rank(s) [0]' in message
    assert 'torch version = "2.4.0" on rank(s) [1]' in message


def test_disagreement_on_length():
    message = describe_disagreement("groups", {(0,): [["a", 1], ["b", 2]], (1,): [["a", 1]]})
    assert "at b: 2 on rank(s) [0]; (nothing) on rank(s) [1]" in message


def test_rank_lists_stay_short_for_large_jobs():
    assert format_ranks([7, 0, 1, 2, 3, 5, 6, 9]) == "[0-3, 5-7, 9]"
    assert format_ranks([1, 2, 4]) == "[1, 2, 4]"
    assert format_ranks(range(512)) == "[0-511]"
    assert format_ranks([4]) == "[4]"
