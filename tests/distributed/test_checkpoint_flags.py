"""The checkpoint flags: --async-save, --ckpt-fully-parallel-save/-load,
--ckpt-assume-constant-structure, --pretrained-checkpoint, --exit-on-missing-checkpoint,
--no-initialization, --dist-ckpt-strictness, --save-retain-interval and the scheduler's resume flags.

On gloo ranks without a model: who writes replicated tensors, reused plans, a background save
published without a collective, failures and crashes mid-write, reads shared out over a group.
End to end (pretrain_gpt.py under torchrun): every combination resumes with the losses of the
uninterrupted run, bit for bit.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from megatron.core.dist_checkpointing.strategies import dcp_chunks
from megatron.core.dist_checkpointing.strategies.dcp_chunks import TensorPieces
from megatron.training.checkpoint.integrity import verify_checkpoint
from tests.distributed import checkpoint_flag_cases as cases
from tests.distributed.test_trainer import PRETRAIN, data, losses, run, small_gpt  # noqa: F401
from tests.launcher import run_ranks, run_script

TRACKER = "latest_checkpointed_iteration.txt"
DP2 = ["--use-distributed-optimizer"]  # at 2 ranks: data parallel, optimizer state sharded


def _files_holding_data(directory) -> collections.Counter:
    metadata = FileSystemReader(str(directory)).read_metadata()
    return collections.Counter(item.relative_path for item in metadata.storage_data.values())


def _load_replicas(directory) -> dict:
    state = cases.replicated_state()
    state["stacked"] = TensorPieces((4, 8), {(layer, 0): torch.empty(1, 8) for layer in range(4)})
    state = {key: (torch.empty_like(value) if torch.is_tensor(value) else value)
             for key, value in state.items()}
    dcp_chunks.load(state, str(directory))
    return state


@pytest.mark.parametrize("spread", [True, False], ids=["fully-parallel", "first-replica"])
def test_replicated_tensors_are_written_by_all_replicas_or_the_first(spread, tmp_path):
    cached = run_ranks(cases.save_replicas, 2, args=(str(tmp_path), spread, "replicas"),
                       timeout_s=120)
    assert cached == [True, True]  # the second save reused the first one's plan
    expected = cases.replicated_state()
    for save in ("first", "second"):
        holders = _files_holding_data(tmp_path / save)
        assert sum(holders.values()) == 6 + 4  # every item once
        assert sorted(holders) == (["__0_0.distcp", "__1_0.distcp"] if spread
                                   else ["__0_0.distcp"])
        loaded = _load_replicas(tmp_path / save)
        for key, value in expected.items():
            if torch.is_tensor(value):
                assert torch.equal(loaded[key], value), key
        assert [float(loaded["stacked"].pieces[(layer, 0)][0, 0]) for layer in range(4)] == \
            [0.0, 1.0, 2.0, 3.0]


def test_a_background_save_is_published_without_a_collective(tmp_path):
    seen = run_ranks(cases.background_save, 2, args=(str(tmp_path), None), timeout_s=120)
    assert seen[0] == "7"  # rank 0 saw the tracker before anyone waited
    final = tmp_path / "iter_0000007"
    assert verify_checkpoint(str(final))
    assert sorted(os.listdir(final)) == ["common.txt", "manifest.json", "tensors"]
    state = {f"rank_{r}": torch.empty(1000) for r in range(2)}
    dcp.load(state, checkpoint_id=str(final / "tensors"), no_dist=True)
    assert all(torch.equal(state[f"rank_{r}"], torch.arange(1000.0) + r) for r in range(2))


def test_a_failed_background_write_is_one_error_on_every_rank(tmp_path):
    errors = run_ranks(cases.background_save, 2, args=(str(tmp_path), 1), timeout_s=120)
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"error: cannot write checkpoint {tmp_path}/iter_0000007.partial:"
                                f" the disk is full or the write failed (rank 1: No space left")
    assert os.listdir(tmp_path) == []  # no tracker, the .partial removed


def test_a_crash_mid_write_publishes_nothing(tmp_path):
    run_ranks(cases.crash_mid_write, 2, args=(str(tmp_path),), timeout_s=120)
    assert os.listdir(tmp_path) == ["iter_0000007.partial"]  # the next save removes it
    assert os.listdir(tmp_path / "iter_0000007.partial" / ".handoff") == ["rank_00000.pkl"]


def test_fully_parallel_reads_share_the_reading_and_give_the_same_tensors():
    results = run_ranks(cases.read_once, 2, timeout_s=120)
    assert all(same for same, _, _ in results)
    assert sum(count for _, count, _ in results) == 8  # each tensor read once in all
    assert all(count > 0 for _, count, _ in results)
    assert [union for _, _, union in results] == [["ids", "t0", "t1"]] * 2


# ---- end to end ---------------------------------------------------------------------------------

def _train(data, iterations: int, *extra) -> dict[int, float]:
    return losses(run(2, small_gpt(data, "--train-iters", str(iterations), *DP2, *extra)))


@pytest.mark.parametrize("save_flags", [
    ["--async-save"],
    ["--async-save", "--ckpt-format", "torch_dist", "--ckpt-assume-constant-structure",
     "--no-ckpt-fully-parallel-save"],
], ids=["layout_free", "torch_dist-first-replica-cached-plans"])
def test_a_background_save_resumes_bit_for_bit(save_flags, data, tmp_path):
    uninterrupted = _train(data, 6, "--save", str(tmp_path), "--save-interval", "2", *save_flags)
    assert (tmp_path / TRACKER).read_text() == "6"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                            TRACKER]
    assert all(verify_checkpoint(str(tmp_path / name)) for name in os.listdir(tmp_path)
               if name.startswith("iter_"))
    if "torch_dist" in save_flags:
        assert list(_files_holding_data(tmp_path / "iter_0000004")) == ["__0_0.distcp"]
    # From the second save: with cached plans, the first that reused one.
    resumed = _train(data, 6, "--load", str(tmp_path), "--ckpt-step", "4",
                     "--ckpt-fully-parallel-load")
    assert resumed == {i: uninterrupted[i] for i in (5, 6)}


def test_pretrained_checkpoint_and_no_initialization(data, tmp_path):
    saved, empty = tmp_path / "saved", tmp_path / "empty"
    run(2, small_gpt(data, "--train-iters", "3", *DP2, "--save", str(saved)))
    finetuned = losses(run(2, small_gpt(data, "--train-iters", "3", *DP2, "--load", str(saved),
                                        "--finetune")))
    output = run(2, small_gpt(data, "--train-iters", "3", *DP2, "--load", str(empty),
                              "--pretrained-checkpoint", str(saved), "--no-initialization"))
    assert f"no checkpoint in --load {empty}: starting from the weights of " \
           f"--pretrained-checkpoint {saved}" in output
    assert "starting training at iteration 0" in output
    assert losses(output) == finetuned


@pytest.mark.parametrize("extra,fails,line", [
    (["--exit-on-missing-checkpoint"], False, ">> '--exit-on-missing-checkpoint' set ... "
                                              "exiting. <<"),
    (["--no-initialization"], True, "error: --no-initialization leaves the weights to a "
                                     "checkpoint, but --load {empty} holds none"),
])
def test_a_load_directory_without_a_checkpoint_stops_in_one_line(extra, fails, line, data,
                                                                 tmp_path):
    result = run_script(PRETRAIN, 1, timeout_s=120, args=small_gpt(
        data, "--train-iters", "3", "--load", str(tmp_path), *extra))
    assert (result.returncode != 0) == fails, result.stdout[-3000:]
    assert line.format(empty=tmp_path) in result.stdout
    assert "starting training" not in result.stdout
    assert "Traceback" not in result.stdout


def test_resume_with_another_lr_names_both_scheduler_flags(data, tmp_path):
    run(1, small_gpt(data, "--train-iters", "3", "--save", str(tmp_path)))
    result = run_script(PRETRAIN, 1, timeout_s=120, args=small_gpt(
        data, "--train-iters", "5", "--load", str(tmp_path), "--lr", "1e-3"))
    assert result.returncode != 0
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "max_lr (--lr) is 0.003 there, 0.001 here" in errors[0]
    assert "--use-checkpoint-opt_param-scheduler" in errors[0]
    assert "--override-opt_param-scheduler" in errors[0]
    resumed = run(1, small_gpt(data, "--train-iters", "5", "--load", str(tmp_path), "--lr",
                               "1e-3", "--override-opt_param-scheduler"))
    assert sorted(losses(resumed)) == [4, 5]


def test_dist_ckpt_strictness_names_the_optimizer_state_a_run_leaves_unread(data, tmp_path):
    # pp 2: the tensors no rank reads are known only from both stages' weights together.
    saved = {}
    for ckpt_format in ("layout_free", "torch_dist"):
        saved[ckpt_format] = tmp_path / ckpt_format
        run(2, small_gpt(data, "--train-iters", "4", "--exit-interval", "3",
                         "--save", str(saved[ckpt_format]),
                         "--pipeline-model-parallel-size", "2", "--ckpt-format", ckpt_format))

    def resumed(ckpt_format, *extra):
        return small_gpt(data, "--train-iters", "4", "--load", str(saved[ckpt_format]),
                         "--pipeline-model-parallel-size", "2", *extra)

    # Everything read: nothing said, even in the strictest mode.
    output = run(2, resumed("torch_dist", "--dist-ckpt-strictness", "raise_all"))
    assert "do not match" not in output and losses(output).keys() == {4}
    output = run(2, resumed("layout_free", "--no-load-optim", "--dist-ckpt-strictness",
                            "log_all"))
    warnings = [line for line in output.splitlines() if "do not match" in line]
    assert len(warnings) == 1, warnings  # said once, by rank 0
    assert f"WARNING: checkpoint {saved['layout_free']}/iter_0000003 and this run do not " \
           f"match: " in warnings[0]
    assert "tensor(s) of the checkpoint that no rank reads: optimizer.state." in warnings[0]
    assert losses(output).keys() == {4}
    result = run_script(PRETRAIN, 2, timeout_s=120, args=resumed(
        "torch_dist", "--no-load-optim", "--dist-ckpt-strictness", "raise_all"))
    assert result.returncode != 0
    errors = {line for line in result.stdout.splitlines() if line.startswith("error: ")}
    assert len(errors) == 1, result.stdout[-3000:]
    error = errors.pop()
    assert "no rank reads: optimizer.state." in error and ", ... and " in error
    assert error.endswith("(--dist-ckpt-strictness raise_all)")
    assert "Traceback" not in result.stdout and "starting training" not in result.stdout


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async-save"])
def test_save_retain_interval_keeps_its_multiples_and_the_latest(background, data, tmp_path):
    run(2, small_gpt(data, "--train-iters", "5", "--save", str(tmp_path), "--save-interval", "1",
                     "--save-retain-interval", "2", "--pipeline-model-parallel-size", "2",
                     *(["--async-save"] if background else [])))
    assert sorted(name for name in os.listdir(tmp_path) if name.startswith("iter_")) == [
        "iter_0000002", "iter_0000004", "iter_0000005"]
    assert (tmp_path / TRACKER).read_text() == "5"
