"""``--dist-ckpt-strictness`` at the trainer's load: each mode against a checkpoint that holds a
tensor the model lacks and one whose model tensor it lacks (one process; the trainer runs of
tests/distributed/test_checkpoint_strictness.py cover the flags end to end)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.checkpoint.model_tensors import model_tensors
from megatron.training.checkpoint.source import CheckpointSource, optimizer_key
from megatron.training.checkpoint.strictness import check_shared_keys
from tests.support.gpt_support import build_gpt, small_config

EXTRA = "decoder.layers.9.mlp.linear_fc1.weight"  # a layer this model does not have


class Stored(CheckpointSource):
    """A checkpoint known by its tensors' names and shapes only."""

    def __init__(self, shapes, optimizer_keys=(), format="layout_free"):
        super().__init__(path="/ckpt/iter_0000002", format=format, iteration=2, args={},
                         shapes=dict(shapes))
        self._optimizer_keys = set(optimizer_keys)

    def read(self, names):
        raise AssertionError("the check reads nothing")

    def stored_optimizer_keys(self):
        return self._optimizer_keys


@pytest.fixture(scope="module")
def model():
    return [build_gpt(small_config(num_layers=2))]


def _names(model):
    return sorted(name for name, _, _ in model_tensors(model))


def _with_mismatches(model, format="layout_free"):
    """Every weight of ``model`` but its final norm's, plus a layer it does not have, and Adam's
    state of one weight."""
    names = _names(model)
    shapes = {name: torch.Size([1]) for name in names if name != "decoder.final_layernorm.weight"}
    shapes[EXTRA] = torch.Size([1])
    kept = names[0]
    return Stored(shapes, {optimizer_key("exp_avg", kept), optimizer_key("exp_avg", EXTRA)},
                  format), kept


@pytest.mark.parametrize("mode", ["assume_ok_unexpected", "ignore_all"])
def test_silent_modes_look_for_nothing(model, mode, capsys):
    source, _ = _with_mismatches(model)
    check_shared_keys(source, model, mode, with_optimizer=True)
    assert capsys.readouterr().out == ""


def test_log_unexpected_names_what_the_run_reads_and_the_checkpoint_lacks_then_stops(model,
                                                                                   capsys):
    source, _ = _with_mismatches(model)
    with pytest.raises(CheckpointError, match=r"lacks 1 weight\(s\) of this model, logged above"):
        check_shared_keys(source, model, "log_unexpected", with_optimizer=True)
    out = capsys.readouterr().out
    assert ("1 tensor(s) this run reads that the checkpoint lacks: "
            "decoder.final_layernorm.weight") in out
    assert EXTRA not in out


def test_log_all_also_names_what_no_rank_reads(model, capsys):
    source, kept = _with_mismatches(model)
    with pytest.raises(CheckpointError):  # the final norm's weight is still not there
        check_shared_keys(source, model, "log_all", with_optimizer=True)
    out = capsys.readouterr().out
    # the extra layer's weight and its optimizer state; the kept weight's state is read
    assert (f"2 tensor(s) of the checkpoint that no rank reads: {EXTRA}, "
            f"{optimizer_key('exp_avg', EXTRA)}") in out
    assert optimizer_key("exp_avg", kept) not in out
    assert "decoder.final_layernorm.weight" in out


def test_tensors_no_rank_reads_alone_are_logged_and_the_load_goes_on(model, capsys):
    names = _names(model)
    source = Stored({name: torch.Size([1]) for name in names + [EXTRA]},
                    {optimizer_key("exp_avg", names[0])})
    check_shared_keys(source, model, "log_all", with_optimizer=True)
    assert f"1 tensor(s) of the checkpoint that no rank reads: {EXTRA}\n" in \
        capsys.readouterr().out
    # without the optimizer, all of its state is unread
    check_shared_keys(source, model, "log_all", with_optimizer=False)
    out = capsys.readouterr().out
    assert f"2 tensor(s) of the checkpoint that no rank reads: {EXTRA}, " \
           f"{optimizer_key('exp_avg', names[0])}\n" in out
    assert "this run reads" not in out


@pytest.mark.parametrize("mode, named", [
    ("raise_unexpected", ["decoder.final_layernorm.weight"]),
    ("raise_all", ["decoder.final_layernorm.weight", EXTRA]),
])
def test_raise_modes_stop_the_load_naming_the_tensors(model, mode, named):
    source, _ = _with_mismatches(model)
    with pytest.raises(CheckpointError, match=f"--dist-ckpt-strictness {mode}") as error:
        check_shared_keys(source, model, mode, with_optimizer=True)
    assert all(name in str(error.value) for name in named)
    assert mode == "raise_all" or EXTRA not in str(error.value)


def test_a_matching_checkpoint_passes_every_mode(model, capsys):
    source = Stored({name: torch.Size([1]) for name in _names(model)})
    for mode in ("log_unexpected", "log_all", "raise_unexpected", "raise_all"):
        check_shared_keys(source, model, mode, with_optimizer=True)
    assert capsys.readouterr().out == ""


def test_an_error_names_twenty_tensors_and_counts_the_rest(model):
    source = Stored({f"decoder.layers.{index}.extra.weight": torch.Size([1])
                     for index in range(30)} | {name: torch.Size([1]) for name in _names(model)})
    with pytest.raises(CheckpointError, match=r"30 tensor\(s\) .*, \.\.\. and 10 more"):
        check_shared_keys(source, model, "raise_all", with_optimizer=True)


def test_legacy_torch_checkpoints_are_not_checked(model):
    source, _ = _with_mismatches(model, format="torch")
    check_shared_keys(source, model, "raise_all", with_optimizer=True)


@pytest.mark.parametrize("mode", ["return_unexpected", "return_all"])
def test_return_modes_are_refused_naming_the_flag(mode, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ArgumentError, match=f"--dist-ckpt-strictness {mode}: .* use log_all"):
        validate_args(parse_args(argv=["--dist-ckpt-strictness", mode]))
