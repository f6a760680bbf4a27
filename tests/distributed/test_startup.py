"""Start-up either succeeds on every rank or fails on every rank, in bounded time, saying why.

Each rank is a separate process started like a launcher would (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), running ``initialize_megatron`` on its own command line.
"""

import json
import os
import re

import pytest

from tests.launcher import run_processes

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "start_megatron.py")
TIMEOUT_S = 8
# The bound: every failure ends within the configured start-up timeout + 30 s.
BOUND_S = TIMEOUT_S + 30
BASE = [SCRIPT, "--distributed-backend", "gloo", "--transformer-impl", "local",
        "--distributed-startup-timeout-seconds", str(TIMEOUT_S)]


def started(outcome) -> dict:
    assert outcome.returncode == 0, outcome.output
    match = re.search(r"STARTED (\{.*\})", outcome.output)
    assert match, outcome.output
    return json.loads(match.group(1))


def failure(outcome) -> str:
    assert outcome.returncode not in (0, None), outcome.output
    assert outcome.seconds <= BOUND_S, outcome
    match = re.search(r"STARTUP-ERROR after [0-9.]+s: (.*)", outcome.output)
    assert match, outcome.output
    return match.group(1)


@pytest.mark.parametrize("world,flags,expect", [
    (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     dict(tp=2, pp=2, dp=1, vpp=None)),
    (4, ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
         "--num-layers-per-virtual-pipeline-stage", "1"], dict(tp=1, pp=4, dp=1, vpp=2)),
    (4, ["--tensor-model-parallel-size", "4"], dict(tp=4, pp=1, dp=1, vpp=None)),
    (4, [], dict(tp=1, pp=1, dp=4, vpp=None)),
    (4, ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"],
     dict(tp=1, pp=2, dp=2, vpp=2)),
    (3, ["--pipeline-model-parallel-size", "3"], dict(tp=1, pp=3, dp=1, vpp=None)),
])
def test_normal_start_up(world, flags, expect):
    outcomes = run_processes([BASE + flags] * world, timeout_s=90)
    reports = [started(o) for o in outcomes]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert {k: report[k] for k in expect} == expect
    assert all(r["groups"] == reports[0]["groups"] for r in reports)


def test_ranks_started_with_different_pipeline_sizes_both_fail_naming_the_flag():
    outcomes = run_processes([BASE + ["--pipeline-model-parallel-size", "2"],
                              BASE + ["--pipeline-model-parallel-size", "1"]], timeout_s=90)
    for outcome in outcomes:
        message = failure(outcome)
        assert "--pipeline-model-parallel-size: 2 on rank(s) [0]; 1 on rank(s) [1]" in message


def test_a_rank_creating_groups_in_another_order_fails_everywhere_before_any_group_exists():
    outcomes = run_processes([BASE + ["--pipeline-model-parallel-size", "2"]] * 4,
                             env_per_rank=[{}, {}, {"INJECT_REORDERED_GROUPS": "1"}, {}],
                             timeout_s=90)
    for outcome in outcomes:
        message = failure(outcome)
        assert "process group #0" in message and "on rank(s) [2]" in message
        assert "on rank(s) [0, 1, 3]" in message


def test_a_missing_rank_is_named_by_every_present_rank():
    outcomes = run_processes([BASE, BASE], world_size=3, timeout_s=90)
    for outcome in outcomes:
        message = failure(outcome)
        assert "rank(s) [2] of 3 never reached the rendezvous" in message
        assert outcome.seconds >= TIMEOUT_S - 1  # it waited as configured, then gave up


def test_a_missing_store_host_is_reported_by_every_present_rank():
    outcomes = run_processes([BASE, BASE], ranks=[1, 2], world_size=3, timeout_s=90,
                             host_store=False)
    for rank, outcome in zip((1, 2), outcomes):
        message = failure(outcome)
        assert f"rank {rank} could not reach the rendezvous store" in message
        assert "rank 0, which hosts it, did not start" in message


def test_a_rank_that_cannot_go_on_stops_the_others_at_once():
    outcomes = run_processes([BASE, BASE], env_per_rank=[{}, {"INJECT_DEVICE_FAILURE": "1"}],
                             timeout_s=90)
    for outcome in outcomes:
        assert "injected: no usable device on this rank" in failure(outcome)
        assert outcome.seconds < TIMEOUT_S  # nobody waited for the deadline


def missing_data_flags(backend: str, data_prefix: str, startup_timeout_s: int) -> list[str]:
    """``pretrain_gpt.py``'s flags (after the script) for a tiny GPT at pipeline size 3 whose
    ``--data-path`` prefix need not exist (also run over NCCL by tests/gpu)."""
    return ["--distributed-backend", backend, "--transformer-impl", "local",
            "--distributed-startup-timeout-seconds", str(startup_timeout_s),
            "--pipeline-model-parallel-size", "3", "--num-layers", "3", "--hidden-size", "16",
            "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "1",
            "--train-iters", "1", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--data-path", data_prefix]


def test_missing_data_stops_every_pipeline_stage_before_the_model_is_built(tmp_path):
    """Only the first and last stages read the data, and only they find it missing; the middle
    stage, which would go on into the pipeline's first collective, stops with them."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = [os.path.join(repo, "pretrain_gpt.py"),
             *missing_data_flags("gloo", str(tmp_path / "gone"), TIMEOUT_S)]
    outcomes = run_processes([flags] * 3, timeout_s=90)
    reason = re.escape(f"--data-path: {tmp_path / 'gone'}.idx does not exist")
    for rank, outcome in enumerate(outcomes):
        assert outcome.returncode == 2, outcome.output
        assert outcome.seconds <= BOUND_S, outcome
        # The middle stage reports the first failure published: rank 0's or rank 2's.
        said = rf"error: rank [02]: {reason}" if rank == 1 else f"error: {reason}"
        assert re.search(said, outcome.output), outcome.output
        assert "building GPT model" not in outcome.output


def test_a_world_that_does_not_factor_is_refused_before_any_communication():
    outcomes = run_processes([BASE + ["--tensor-model-parallel-size", "2"]] * 3, timeout_s=90)
    for outcome in outcomes:
        assert outcome.returncode not in (0, None)
        assert outcome.seconds < TIMEOUT_S
        assert ("the world size (3 ranks, $WORLD_SIZE) is not divisible by "
                "--tensor-model-parallel-size 2") in outcome.output


def test_start_up_inside_an_existing_process_group_seeds_each_stage_differently():
    from tests.distributed.startup_cases import start_inside_existing_process_group
    from tests.launcher import run_ranks

    reports = run_ranks(start_inside_existing_process_group, 4, timeout_s=90)
    assert [r["pp_rank"] for r in reports] == [0, 0, 1, 1]
    assert all(r["dp"] == 2 and r["world"] == 4 for r in reports)
    # Data-parallel replicas draw the same numbers; pipeline stages differ.
    assert reports[0]["draw"] == reports[1]["draw"] != reports[2]["draw"] == reports[3]["draw"]


def test_disable_gloo_process_groups_leaves_out_the_gloo_twins_on_every_rank():
    groups = {}
    for flags in ([], ["--disable-gloo-process-groups"]):
        reports = [started(o) for o in run_processes([BASE + flags] * 2, timeout_s=90)]
        assert reports[0]["groups"] == reports[1]["groups"]
        groups[bool(flags)] = {name for name, _ in reports[0]["groups"]}
    assert {name for name in groups[False] if name.endswith("_gloo")} == {"dp_gloo", "dp_cp_gloo"}
    assert groups[True] == {name for name in groups[False] if not name.endswith("_gloo")}
