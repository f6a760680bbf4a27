"""Checkpoints under injected faults, end to end: pretrain_gpt.py on CPU/gloo under torchrun.

Each test injects one fault into real processes and asserts what was lost, which is never more
than the iterations since the last complete checkpoint:

* a rank SIGKILLed while a checkpoint is written: the previous one and its tracker stay; the
  next save removes the leftover ``.partial``; resuming repeats the lost iterations exactly;
* damaged checkpoint files: one line naming the file before training (and before the data is
  built), exit non-zero, no traceback from the ranks;
* a disk that takes no more bytes (RLIMIT_FSIZE: writes fail with EFBIG) during a save: one line
  naming the directory, every rank exits, the previous checkpoint stays the tracker's;
* a rank SIGKILLed mid-training: every other rank ends within the p2p timeout with its flight
  record, and ``tools/diagnose_hang.py`` names the dead rank.
"""

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron.training.checkpoint.integrity import list_files, verify_checkpoint
from tests.distributed.test_trainer import (  # noqa: F401 (data: the fixture)
    PRETRAIN, REPO, data, losses, run, small_gpt)
from tests.launcher import run_script
from tests.support.torchrun_job import TorchrunJob

TRACKER = "latest_checkpointed_iteration.txt"
RANK_TRACEBACK = re.compile(r"\[rank\d+\]: Traceback")
PP2 = ["--pipeline-model-parallel-size", "2"]


def _iter(root, iteration: int):
    return root / f"iter_{iteration:07d}"


def _tracker(root) -> str:
    return (root / TRACKER).read_text()


def _kill_during_save(args, root, iteration: int, victim: int):
    """Start training, freeze both workers as soon as checkpoint ``iteration`` is being written
    (its ``.partial`` exists, the checkpoint does not), then SIGKILL rank ``victim``. Returns
    the files the ``.partial`` held then. Where the save completed before the freeze (the
    machine stalled the test for the whole save), the run is repeated."""
    partial, final = _iter(root, iteration).with_suffix(".partial"), _iter(root, iteration)
    for _ in range(3):
        shutil.rmtree(root, ignore_errors=True)
        with TorchrunJob(PRETRAIN, 2, args) as job:
            job.wait_until(lambda: len(job.workers()) == 2, timeout_s=60)
            workers = job.workers()
            job.wait_until(partial.is_dir, timeout_s=180, poll_s=0.0005)
            for pid in workers.values():
                os.kill(pid, signal.SIGSTOP)
            if final.exists():
                for pid in workers.values():
                    os.kill(pid, signal.SIGCONT)
                job.finish(timeout_s=120)
                continue
            written = list_files(str(partial))
            os.kill(workers[victim], signal.SIGKILL)
            for rank, pid in workers.items():
                if rank != victim:
                    os.kill(pid, signal.SIGCONT)
            assert job.finish(timeout_s=60) != 0, job.output[-3000:]
            return written
    pytest.fail(f"checkpoint {iteration} was complete before the workers could be frozen, 3 times")


def test_sigkill_during_a_save_keeps_the_previous_checkpoint_and_resume_is_exact(data, tmp_path):
    base = small_gpt(data, "--train-iters", "8", *PP2)
    uninterrupted = losses(run(2, base))
    root = tmp_path / "ckpt"
    saving = base + ["--save", str(root), "--save-interval", "4"]

    # Rank 0, which would otherwise remove the .partial when a peer's failure ends the save.
    _kill_during_save(saving, root, iteration=8, victim=0)
    # Lost: the iterations since checkpoint 4, and a leftover .partial; nothing else.
    assert _tracker(root) == "4"
    assert verify_checkpoint(str(_iter(root, 4)))
    assert not _iter(root, 8).exists() and _iter(root, 8).with_suffix(".partial").is_dir()

    output = run(2, saving + ["--load", str(root)])
    assert f"removing {_iter(root, 8)}.partial, left by an interrupted save" in output
    resumed = losses(output)
    assert sorted(resumed) == [5, 6, 7, 8]
    for iteration, value in resumed.items():
        assert value == uninterrupted[iteration], iteration  # bit for bit, as printed
    assert _tracker(root) == "8" and verify_checkpoint(str(_iter(root, 8)))
    # p2p_hang/: the survivor's flight record from the killed run (the default --p2p-dump-dir).
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", "iter_0000008",
                                                      TRACKER, "p2p_hang"]
    assert os.listdir(root / "p2p_hang") == ["rank1.json"]


@pytest.fixture(scope="module")
def saved(data, tmp_path_factory):
    """A pp 2 checkpoint at iteration 3 (the one every damage case copies)."""
    root = tmp_path_factory.mktemp("saved")
    run(2, small_gpt(data, "--train-iters", "3", "--eval-iters", "0", "--save", str(root), *PP2))
    return root


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _flip_bytes(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        middle = f.read(16)
        f.seek(-len(middle), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in middle))


def _garbage(path):
    with open(path, "wb") as f:
        f.write(b"not a checkpoint" * 10)


def _retarget_tracker(path):
    with open(path, "w") as f:
        f.write("7")


DAMAGE = {
    "truncated-shard": ("iter_0000003/model/__1_0.distcp", _truncate,
                        "iter_0000003/model/__1_0.distcp has {size} bytes, manifest.json lists"),
    "flipped-shard": ("iter_0000003/optimizer/__0_0.distcp", _flip_bytes,
                      "iter_0000003/optimizer/__0_0.distcp does not match its CRC-32"),
    "missing-rank-file": ("iter_0000003/rng/rank_00001.pt", os.remove,
                          "iter_0000003/rng/rank_00001.pt is missing (manifest.json lists it)"),
    "missing-shard": ("iter_0000003/model/__0_0.distcp", os.remove,
                      "iter_0000003/model/__0_0.distcp is missing"),
    "tracker-names-no-directory": (TRACKER, _retarget_tracker,
                                   f"{TRACKER} names iteration 7, but {{root}}/iter_0000007 does "
                                   f"not exist"),
    "corrupt-common": ("iter_0000003/common.pt", _flip_bytes,
                       "iter_0000003/common.pt does not match its CRC-32"),
    "corrupt-common-without-manifest": ("iter_0000003/common.pt", _garbage,
                                        "iter_0000003/common.pt is unreadable or corrupt"),
}
SLOW_DAMAGE = ("missing-shard", "corrupt-common")


@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.slow)
                                  if name in SLOW_DAMAGE else name for name in DAMAGE])
def test_damaged_checkpoint_is_named_in_one_line_before_training(case, saved, data, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    name, damage, message = DAMAGE[case]
    if case.endswith("without-manifest"):  # as saved before manifests were written
        os.remove(root / "iter_0000003" / "manifest.json")
    damage(root / name)
    message = message.format(root=root, size=os.path.getsize(root / name)
                             if (root / name).exists() else 0)
    started = time.monotonic()
    result = run_script(PRETRAIN, 2, timeout_s=120, args=small_gpt(
        data, "--train-iters", "6", "--load", str(root), *PP2))
    output = result.stdout
    assert result.returncode != 0
    assert "error: " in output and message in output, output[-3000:]
    error_line = next(line for line in output.splitlines() if line.startswith("error: "))
    assert str(root) in error_line
    assert "Traceback" not in output, output[-3000:]
    # Before the data is built, let alone a training step.
    assert "building train, validation, and test datasets" not in output
    assert not losses(output)
    if case.endswith("without-manifest"):
        assert "has no manifest.json (saved before manifests were written)" in output
    assert time.monotonic() - started < 60


def _file_size_limit(limit_bytes: int):
    def apply():  # in torchrun before it starts; its workers inherit the limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def test_full_disk_during_a_save_names_the_directory_and_keeps_the_previous_checkpoint(
        data, tmp_path):
    root = tmp_path / "ckpt"
    # The same data on both runs: the second writes nothing but the checkpoint.
    base = small_gpt(data, "--train-iters", "8", "--eval-iters", "0", "--save", str(root),
                     "--save-interval", "4", *PP2)
    run(2, base + ["--exit-interval", "4"])
    assert _tracker(root) == "4"
    # Every file up to 256 KiB still fits, the checkpoint's shards (about 1-2 MiB) do not.
    started = time.monotonic()
    with TorchrunJob(PRETRAIN, 2, base + ["--load", str(root)],
                     preexec_fn=_file_size_limit(256 << 10)) as job:
        returncode = job.finish(timeout_s=120)
    output = job.output
    assert returncode != 0
    assert sorted(losses(output)) == [5, 6, 7, 8], output[-3000:]  # lost: these, since ckpt 4
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, output[-3000:]  # one line from each rank
    assert errors[0].startswith(f"error: cannot write checkpoint {_iter(root, 8)}.partial: the "
                                f"disk is full or the write failed (")
    assert "files limited to 0.25 MiB (ulimit -f)" in errors[0]
    assert f"{root / TRACKER} still names the last complete checkpoint" in errors[0]
    assert not RANK_TRACEBACK.search(output), output[-3000:]
    assert time.monotonic() - started < 90
    assert _tracker(root) == "4" and verify_checkpoint(str(_iter(root, 4)))
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", TRACKER]


def _kill_mid_training(data, tmp_path, pp: int, victim: int):
    dump_dir = tmp_path / "flight"
    args = small_gpt(data, "--train-iters", "1000", "--pipeline-model-parallel-size", str(pp),
                     "--p2p-timeout-seconds", "5", "--p2p-dump-dir", str(dump_dir))
    with TorchrunJob(PRETRAIN, pp, args) as job:
        job.wait_until(lambda: max(losses(job.output), default=0) >= 3, timeout_s=180)
        job.signal_worker(victim, signal.SIGKILL)
        killed = time.monotonic()
        assert job.finish(timeout_s=60) != 0
        ended_after = time.monotonic() - killed
    assert ended_after < 5, ended_after  # within --p2p-timeout-seconds
    survivors = sorted(set(range(pp)) - {victim})
    assert sorted(os.listdir(dump_dir)) == [f"rank{rank}.json" for rank in survivors]
    diagnosis = subprocess.run([sys.executable, os.path.join(REPO, "tools", "diagnose_hang.py"),
                                str(dump_dir)], capture_output=True, text=True, timeout=60)
    assert diagnosis.returncode == 0, diagnosis.stdout + diagnosis.stderr
    return diagnosis.stdout.splitlines()


def test_rank_killed_mid_training_is_named_by_the_survivors_flight_records(data, tmp_path):
    lines = _kill_mid_training(data, tmp_path, pp=4, victim=1)
    # Both neighbours wait on it, unless torchrun's SIGTERM found one computing, or the peers
    # were in a collective (the gradient norm's all-reduce) that failed instead.
    assert re.fullmatch(r"rank 1 wrote no flight record: it died or never reached the pipeline; "
                        r"((ranks 0 and 2 were|rank [02] was) waiting on it|no p2p operation "
                        r"waited on it, but rank \d's record says the run failed outside p2p: "
                        r".*)", lines[0]), lines


@pytest.mark.slow
def test_first_stage_killed_at_pp2_is_named(data, tmp_path):
    lines = _kill_mid_training(data, tmp_path, pp=2, victim=0)
    assert lines[0].startswith("rank 0 wrote no flight record: it died or never reached the "
                               "pipeline;"), lines
