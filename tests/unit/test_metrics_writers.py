"""Optional logging backends: TensorBoard and wandb when installed, one warning line when not."""

import glob
import sys
import types

import pytest
import torch

from megatron.training import metrics_writers
from megatron.training.arguments import (
    ArgumentError, parse_args, validate_args, validate_training_args,
)


def parsed(*argv):
    return parse_args(argv=["--distributed-backend", "gloo", *argv])


class FakeWandb(types.ModuleType):
    """Records what the writer asks of wandb."""

    def __init__(self):
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))

    def log(self, data, step):
        self.calls.append(("log", data, step))

    def finish(self):
        self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    return wandb


@pytest.fixture
def no_tensorboard(monkeypatch):
    # A None entry makes the import fail as it does where the package is not installed.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_nothing_requested_means_no_writer(capsys):
    assert metrics_writers.build_writer(parsed()) is None
    assert capsys.readouterr().out == ""


def test_tensorboard_writes_event_files(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    writer = metrics_writers.build_writer(parsed("--tensorboard-dir", str(tmp_path)))
    assert isinstance(writer, metrics_writers.TensorBoardWriter)
    writer.add_scalar("lm loss", 2.5, 1)
    writer.close()
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))
    assert capsys.readouterr().out == ""


def test_missing_tensorboard_warns_once_and_trains_on(tmp_path, capsys, no_tensorboard):
    assert metrics_writers.build_writer(parsed("--tensorboard-dir", str(tmp_path))) is None
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert "--tensorboard-dir" in lines[0] and "pip install tensorboard" in lines[0]


def test_missing_wandb_warns_once(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    args = parsed("--wandb-project", "p", "--wandb-exp-name", "run")
    assert metrics_writers.build_writer(args) is None
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert "--wandb-project" in lines[0] and "pip install wandb" in lines[0]


def test_wandb_gets_plain_config_and_the_scalars(fake_wandb, tmp_path, capsys):
    args = parsed("--wandb-project", "proj", "--wandb-exp-name", "run1",
                  "--wandb-save-dir", str(tmp_path / "wb"))
    args.params_dtype = torch.bfloat16  # validate_args adds values like this one
    writer = metrics_writers.build_writer(args)
    writer.add_scalar("learning-rate", 1e-3, 7)
    writer.close()
    (_, init), log, finish = fake_wandb.calls
    assert init["project"] == "proj" and init["name"] == "run1"
    assert init["dir"] == str(tmp_path / "wb") and (tmp_path / "wb").is_dir()
    assert init["config"]["params_dtype"] == "torch.bfloat16"
    assert init["config"]["wandb_project"] == "proj"
    assert log == ("log", {"learning-rate": 1e-3}, 7) and finish == ("finish",)
    assert capsys.readouterr().out == ""


def test_wandb_dir_defaults_under_save(fake_wandb, tmp_path):
    metrics_writers.build_writer(parsed("--wandb-project", "p", "--wandb-exp-name", "r",
                                        "--save", str(tmp_path)))
    assert fake_wandb.calls[0][1]["dir"] == str(tmp_path / "wandb")
    assert "entity" not in fake_wandb.calls[0][1]  # wandb's default


def test_wandb_entity_names_the_team(fake_wandb):
    metrics_writers.build_writer(parsed("--wandb-project", "p", "--wandb-exp-name", "r",
                                        "--wandb-entity", "team"))
    assert fake_wandb.calls[0][1]["entity"] == "team"


def test_wandb_still_logs_when_tensorboard_is_missing(fake_wandb, tmp_path, capsys,
                                                      no_tensorboard):
    writer = metrics_writers.build_writer(parsed(
        "--tensorboard-dir", str(tmp_path), "--wandb-project", "p", "--wandb-exp-name", "r"))
    assert isinstance(writer, metrics_writers.WandbWriter)
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_both_backends_get_every_scalar(fake_wandb, tmp_path):
    pytest.importorskip("tensorboard")
    writer = metrics_writers.build_writer(parsed(
        "--tensorboard-dir", str(tmp_path), "--wandb-project", "p", "--wandb-exp-name", "r"))
    assert isinstance(writer, metrics_writers.FanOut)
    writer.add_scalar("grad-norm", 0.5, 3)
    writer.close()
    assert ("log", {"grad-norm": 0.5}, 3) in fake_wandb.calls
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))


def test_only_the_last_rank_writes_or_warns(monkeypatch, tmp_path, capsys, no_tensorboard):
    monkeypatch.setattr(metrics_writers, "is_last_rank", lambda: False)
    metrics_writers.start(parsed("--tensorboard-dir", str(tmp_path)))
    assert metrics_writers.get_writer() is None
    assert capsys.readouterr().out == ""


def test_wandb_project_needs_an_experiment_name(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = validate_args(parsed(
        "--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "8",
        "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "64", "--wandb-project", "p"))
    with pytest.raises(ArgumentError, match="--wandb-project needs --wandb-exp-name"):
        validate_training_args(args)


def scalars_in(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_also_plots_against_samples_and_keeps_text(tmp_path):
    pytest.importorskip("tensorboard")
    writer = metrics_writers.build_writer(parsed("--tensorboard-dir", str(tmp_path),
                                                 "--tensorboard-queue-size", "5"))
    assert writer._writer.max_queue == 5
    writer.add_scalar("lm loss", 2.5, 3, samples=96)
    writer.add_scalar("mem-allocated-bytes", 7.0, 3)
    writer.add_text("seed", "1234", 0)
    writer.close()
    events = scalars_in(tmp_path)
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(3, 2.5)]
    assert [(e.step, e.value) for e in events.Scalars("lm loss vs samples")] == [(96, 2.5)]
    assert "mem-allocated-bytes vs samples" not in events.Tags()["scalars"]
    assert "seed/text_summary" in events.Tags()["tensors"]


def test_wandb_steps_only_grow_and_it_gets_samples_vs_steps(fake_wandb):
    writer = metrics_writers.build_writer(parsed("--wandb-project", "p", "--wandb-exp-name", "r"))
    writer.add_scalar("lm loss", 2.5, 3, samples=96)
    writer.add_scalar("grad-norm", 0.5, 3, samples=96)
    writer.add_text("seed", "1234", 0)
    logs = [call[1:] for call in fake_wandb.calls if call[0] == "log"]
    assert logs == [({"samples vs steps": 96}, 3), ({"lm loss": 2.5}, 3), ({"grad-norm": 0.5}, 3)]


def test_finish_closes_the_job_writer_once(fake_wandb, monkeypatch):
    monkeypatch.setattr(metrics_writers, "is_last_rank", lambda: True)
    metrics_writers.start(parsed("--wandb-project", "p", "--wandb-exp-name", "r"))
    metrics_writers.finish()
    metrics_writers.finish()
    assert metrics_writers.get_writer() is None
    assert [call for call in fake_wandb.calls if call[0] == "finish"] == [("finish",)]
