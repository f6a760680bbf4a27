"""--save-retain-interval: publishing a checkpoint deletes the one saved before it unless its
iteration is a multiple of the interval (later upstream's flag and rule)."""

from __future__ import annotations

import os

import pytest

from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.checkpoint.formats import TRACKER, checkpoint_dir
from megatron.training.checkpoint.save_job import publish


def _save(root, iteration: int, retain) -> None:
    partial = checkpoint_dir(str(root), iteration) + ".partial"
    os.makedirs(partial)
    open(os.path.join(partial, "common.pt"), "w").close()
    publish(partial, checkpoint_dir(str(root), iteration), str(root), iteration, retain)


def _kept(root) -> list[str]:
    return sorted(name for name in os.listdir(root) if name != TRACKER)


def test_saves_between_the_retained_ones_go_once_superseded(tmp_path, capsys):
    for iteration in range(1, 7):
        _save(tmp_path, iteration, retain=2)
    assert _kept(tmp_path) == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert (tmp_path / TRACKER).read_text() == "6"
    assert capsys.readouterr().out.count("deleted checkpoint") == 3  # 1, 3 and 5
    _save(tmp_path, 7, retain=2)
    _save(tmp_path, 9, retain=2)
    assert _kept(tmp_path) == ["iter_0000002", "iter_0000004", "iter_0000006", "iter_0000009"]


def test_without_the_flag_every_save_stays(tmp_path):
    for iteration in (1, 2, 3):
        _save(tmp_path, iteration, retain=None)
    assert _kept(tmp_path) == ["iter_0000001", "iter_0000002", "iter_0000003"]


def test_a_symbolic_link_and_a_release_are_kept(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "iter_0000003").mkdir(parents=True)
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(elsewhere / "iter_0000003", root / "iter_0000003")
    (root / TRACKER).write_text("3")
    _save(root, 4, retain=2)
    assert os.path.islink(root / "iter_0000003") and "a symbolic link" in capsys.readouterr().out
    (root / TRACKER).write_text("release")
    _save(root, 5, retain=2)
    assert "iter_0000004" in _kept(root)


@pytest.mark.parametrize("argv, message", [
    (["--save-retain-interval", "4"], "--save-retain-interval 4 needs --save"),
    (["--save", "/ckpt", "--save-retain-interval", "0"], "a positive number"),
    (["--save", "/ckpt", "--save-interval", "3", "--save-retain-interval", "4"],
     "--save-retain-interval 4 must be a multiple of --save-interval 3"),
])
def test_the_interval_is_checked_against_the_save_flags(argv, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ArgumentError, match=message):
        validate_args(parse_args(argv=["--distributed-backend", "gloo", *argv]))


def test_a_failed_deletion_only_warns(tmp_path, capsys, monkeypatch):
    _save(tmp_path, 3, retain=2)
    monkeypatch.setattr("shutil.rmtree", lambda path: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", path)))
    _save(tmp_path, 4, retain=2)  # published all the same
    assert (tmp_path / TRACKER).read_text() == "4"
    assert "WARNING: could not delete checkpoint" in capsys.readouterr().out


def test_the_next_save_removes_what_an_interrupted_deletion_left(tmp_path, capsys):
    from megatron.training.checkpointing import _remove_partials

    (tmp_path / "iter_0000001.deleting" / "model").mkdir(parents=True)  # a crash mid-way
    (tmp_path / "iter_0000002").mkdir()
    _remove_partials(str(tmp_path))
    assert _kept(tmp_path) == ["iter_0000002"]
    assert "left by an interrupted save or deletion" in capsys.readouterr().out
