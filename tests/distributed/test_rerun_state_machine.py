"""``--rerun-mode`` across ranks and end to end: pretrain_gpt.py on CPU/gloo ranks saves the
iteration of a reproduced fault and exits 16; resumed from that checkpoint on another node it
exits 17 with the diagnosis (on the same node, 16 again); a transient fault exits 17 at once;
validating or reporting changes no loss; later upstream's own CI cases of the machine run
scaled down. Another node is a rank whose ``socket.gethostname`` answers another name
(``_other_node_script``)."""

from __future__ import annotations

import re

import pytest

from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION as FAILED,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE as RESUME,
)
from tests.distributed import rerun_cases
from tests.distributed.test_trainer import (  # noqa: F401 (data: the fixture)
    PRETRAIN, data, losses, run, small_gpt)
from tests.distributed.upstream_config_cases import scaled_down
from tests.launcher import run_ranks, run_script

VALIDATE = ["--rerun-mode", "validate_results"]


def test_the_rank_that_failed_re_checks_its_result_from_the_first_replica_s_copy():
    per_rank = run_ranks(rerun_cases.one_rank_fails, 4, args=(2,), timeout_s=60)
    for rank, outcome in enumerate(per_rank):
        assert outcome["first"] == (2, (True, True, RESUME)), rank
        assert outcome["second"] == (1, (False, True, FAILED)), rank
        assert outcome["checks_its_own"] == (rank == 2), rank
        assert outcome["failures"] == [False, False, True, False]


def _other_node_script(tmp_path) -> str:
    script = tmp_path / "on_another_node.py"
    script.write_text(
        "import runpy, socket, sys\n"
        "socket.gethostname = lambda: 'another-node'\n"
        f"sys.argv[0] = {PRETRAIN!r}\n"
        f"runpy.run_path({PRETRAIN!r}, run_name='__main__')\n")
    return str(script)


def _job(data, nproc, *extra, script=PRETRAIN):
    args = small_gpt(data, "--train-iters", "4", "--eval-iters", "0", *extra)
    result = run_script(script, nproc, args=args, timeout_s=180)
    return result.returncode, result.stdout


@pytest.mark.parametrize("ckpt_format", ["layout_free", "torch_dist", "torch"])
def test_a_reproduced_fault_is_saved_then_diagnosed_on_another_node(data, tmp_path, ckpt_format):
    saving = [*VALIDATE, "--error-injection-rate", "1", "--error-injection-type",
              "persistent_error", "--save", str(tmp_path / "ckpt"), "--ckpt-format", ckpt_format]
    code, output = _job(data, 2, *saving)
    assert code == RESUME, output[-3000:]
    assert "Injecting error type Persistent error" in output
    assert "First rerun: unexpected result is reproducible within the tolerance" in output
    assert "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to " \
           "rerun the last iteration and establish a diagnostic" in output
    assert " iteration        2/" not in output  # the optimizer did not step on it
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"

    resuming = [*saving, "--load", str(tmp_path / "ckpt")]
    code, output = _job(data, 2, *resuming)
    assert code == RESUME, output[-3000:]
    assert "Got rescheduled on the same GPU" in output

    code, output = _job(data, 2, *resuming, script=_other_node_script(tmp_path))
    assert code == FAILED, output[-3000:]
    assert "Second rerun: unexpected result is not reproducible on a different GPU" in output
    assert "Rank 1, node another-node, device -1, iteration #2: Possible persistent error!!" \
        in output


def test_a_correct_result_and_a_transient_fault(data, tmp_path):
    saving = [*VALIDATE, "--error-injection-rate", "1", "--save", str(tmp_path / "ckpt")]
    code, output = _job(data, 1, *saving, "--error-injection-type", "correct_result")
    assert code == RESUME, output[-3000:]
    code, output = _job(data, 1, *saving, "--error-injection-type", "correct_result",
                        "--load", str(tmp_path / "ckpt"), script=_other_node_script(tmp_path))
    assert code == FAILED, output[-3000:]
    assert "therefore it was likely correct" in output
    assert "Correct result (but possible Application error)" in output

    tracker = tmp_path / "rejected.txt"
    code, output = _job(data, 1, *saving, "--error-injection-type", "transient_error",
                        "--result-rejected-tracker-filename", str(tracker))
    assert code == FAILED, output[-3000:]
    assert "Possible transient error!" in output
    assert [line.split("status=")[1].split()[0] for line in tracker.read_text().splitlines()] \
        == ["initial_run", "first_rerun_not_reproducible"]
    assert "Exiting now. The job can be resumed from a previous checkpoint" in output


def test_validating_and_reporting_change_no_loss(data):
    layout = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
              "2", "--train-iters", "4"]
    plain = losses(run(2, small_gpt(data, *layout)))
    validated = run(2, small_gpt(data, *layout, *VALIDATE, "--check-for-spiky-loss"))
    reported = run(2, small_gpt(data, *layout, "--rerun-mode", "report_stats"))
    assert losses(validated) == plain == losses(reported) and sorted(plain) == [1, 2, 3, 4]
    assert "Stats on computation determinism in validation calls" in reported
    assert "all identical" in reported


def test_without_save_a_reproduced_fault_stops_without_a_diagnosis(data):
    code, output = _job(data, 1, *VALIDATE, "--error-injection-rate", "1",
                        "--error-injection-type", "persistent_error")
    assert code == FAILED, output[-3000:]
    assert "without --save there is no checkpoint to re-run the iteration from" in output


def test_upstream_s_rerun_ci_configurations_scaled_down(data, tmp_path):
    """Later upstream's own CI cases of the machine (pp 2, sequence parallelism, bf16, the
    overlapped distributed optimizer, background torch_dist saves), scaled down, one fault
    injected at the first validated iteration; each log shows what upstream's CI greps."""
    persistent = scaled_down("main/gpt3_mcore_reruns_persistent_1",
                             ("--error-injection-rate", "1"), data=data, out=tmp_path)
    result = run_script(PRETRAIN, persistent.world_size, args=persistent.argv, timeout_s=300)
    assert result.returncode == RESUME, result.stdout[-4000:]
    for line in ("Result validation enabled", "Injecting error type Persistent error",
                 "First rerun: unexpected result is reproducible within the tolerance",
                 "Saving a checkpoint and exiting now. Please resume the job from the checkpoint "
                 "to rerun the last iteration and establish a diagnostic"):
        assert line in result.stdout, line
    # The same flags load it (its --load is its --save) on another node.
    result = run_script(_other_node_script(tmp_path), persistent.world_size,
                        args=persistent.argv, timeout_s=300)
    assert result.returncode == FAILED, result.stdout[-4000:]
    assert "Possible persistent error!!" in result.stdout

    transient = scaled_down("main/gpt3_mcore_reruns_transient", ("--error-injection-rate", "1"),
                            data=data, out=tmp_path / "transient")
    result = run_script(PRETRAIN, transient.world_size, args=transient.argv, timeout_s=300)
    assert result.returncode == FAILED, result.stdout[-4000:]
    assert re.search(r"Rank [0-9]+, node [0-9a-z-]+, device -?[0-9]+, iteration #2: Possible "
                     r"transient error!!", result.stdout)


def test_a_real_nan_reproduces_and_is_diagnosed_as_what_the_input_gives(data, tmp_path):
    # No injection: a learning rate of 1e12 makes the second iteration's loss NaN.
    flags = [*VALIDATE, "--lr", "1e12", "--lr-warmup-iters", "0", "--clip-grad", "0",
             "--save", str(tmp_path / "ckpt")]
    code, output = _job(data, 1, *flags)
    assert code == RESUME, output[-3000:]
    assert "First rerun: unexpected result is reproducible within the tolerance (nan = nan)" \
        in output
    code, output = _job(data, 1, *flags, "--load", str(tmp_path / "ckpt"),
                        script=_other_node_script(tmp_path))
    assert code == FAILED, output[-3000:]
    assert "Correct result (but possible Application error) (found NaN in local forward loss " \
           "calculation (look at the batch this rank read and at the learning rate" in output


def test_disabled_a_real_nan_stops_the_job_in_its_iteration_naming_the_loss(data):
    """``--rerun-mode disabled`` (the default): the NaN loss of the second iteration is judged
    in that iteration's optimizer step (its checks deferred until then), before the update."""
    code, output = _job(data, 1, "--lr", "1e12", "--lr-warmup-iters", "0", "--clip-grad", "0")
    assert code != 0, output[-3000:]
    assert re.search(r"Rank 0, node \S+, device -1, iteration 2: Unexpected result nan "
                     r"\(message='found NaN in local forward loss", output), output[-3000:]
