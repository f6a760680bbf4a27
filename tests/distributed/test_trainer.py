"""pretrain_gpt.py end to end on CPU/gloo, launched with torchrun as users do.

The report's flag set scaled down at pp 4 and pp 2 x vpp 2; the pp 2 x vpp 2 loss curve equals
pp 1's; SIGTERM, save and resume continue the same curve; a checkpoint saved at pp 2 x vpp 2
loads at pp 1 and pp 4 with the same evaluation loss; bad input fails in seconds; missing
TensorBoard or wandb costs one warning line each, not the run.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.launcher import run_script, run_torchrun

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([0-9.E+-]+) \|")
TEST_LOSS = re.compile(r"validation loss at iteration \d+ on test set \| "
                       r"lm loss value: ([0-9.E+-]+)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart-data")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_quickstart_data.py"),
                    str(out)], check=True, capture_output=True, timeout=120)
    return out


def small_gpt(data, *extra):
    return ["--distributed-backend", "gloo", "--transformer-impl", "local",
            "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--adam-beta2", "0.95", "--log-interval", "1",
            "--eval-interval", "1000", "--eval-iters", "2", "--num-workers", "0",
            "--data-path", str(data / "corpus_text_document"), "--split", "949,50,1",
            "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
            str(data / "tokenizer.model"), "--data-cache-path", str(data / "cache"), *extra]


PP2_VPP2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
            "2", "--variable-seq-lengths", "--no-overlap-p2p-communication"]


def losses(output: str) -> dict[int, float]:
    return {int(i): float(v) for i, v in LOSS.findall(output)}


def run(nproc, args, timeout_s=240):
    """pretrain_gpt.py on ``nproc`` ranks as torchrun's workers (see ``run_script``); the tests
    of the launch itself use ``run_torchrun``."""
    result = run_script(PRETRAIN, nproc, args=args, timeout_s=timeout_s)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def example(script, nproc, data, tmp_path, *extra, train_iters=3):
    """Run an examples/gpt3_7b script; its torchrun binds MASTER_PORT itself, so a start that
    lost the port to a parallel test is retried on another."""
    from tests.launcher import free_port, launch_tool

    for _ in range(3):
        env = {**os.environ,
               "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               "GPUS_PER_NODE": str(nproc), "NUM_LAYERS": "4", "TRAIN_ITERS": str(train_iters),
               "GLOBAL_BATCH_SIZE": "8", "TRANSFORMER_IMPL": "local",
               "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
        command = ["bash", os.path.join(REPO, "examples", "gpt3_7b", script),
                   str(tmp_path / "ckpt"), str(tmp_path / "tb"),
                   str(data / "corpus_text_document"), str(data / "tokenizer.model"),
                   "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
                   "--max-position-embeddings", "64", "--distributed-backend", "gloo",
                   "--eval-iters", "1", "--num-workers", "0", "--initial-loss-scale", "4096",
                   *extra]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        if result.returncode == 0 or not launch_tool().address_in_use(result.stdout
                                                                         + result.stderr):
            return result
    return result


@pytest.mark.parametrize("script,nproc", [("train_gpt3_7b_pp4.sh", 4),
                                          ("train_gpt3_7b_pp2_vpp2.sh", 2)])
def test_report_flag_set_scaled_down_runs_to_completion(script, nproc, data, tmp_path):
    result = example(script, nproc, data, tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "iteration        3/       3" in result.stdout
    assert TEST_LOSS.search(result.stdout)
    assert os.path.isfile(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
    assert os.listdir(tmp_path / "tb")  # TensorBoard events from the last rank


def test_report_scripts_continue_from_an_upstream_torch_dist_checkpoint(data, tmp_path):
    # pp 4 writes upstream's format (what megatron-core loads, see tests/upstream); the pp 2 x
    # vpp 2 script then finds it under its --load and trains on from iteration 3.
    saved = example("train_gpt3_7b_pp4.sh", 4, data, tmp_path, "--ckpt-format", "torch_dist")
    assert saved.returncode == 0, (saved.stdout + saved.stderr)[-4000:]
    assert os.path.isfile(tmp_path / "ckpt" / "iter_0000003" / "metadata.json")

    # Our torch_dist saves carry the optimizer state (upstream's plain-optimizer layout).
    # Trained on to iteration 5: the schedule of 3 iterations saved with it is kept, as upstream
    # keeps it with this flag (and refuses the run without it).
    resumed = example("train_gpt3_7b_pp2_vpp2.sh", 2, data, tmp_path,
                      "--use-checkpoint-opt_param-scheduler", train_iters=5)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert ("loaded upstream torch_dist checkpoint" in resumed.stdout
            and "(model weights, optimizer state and scheduler)" in resumed.stdout)
    assert sorted(losses(resumed.stdout)) == [4, 5]


def test_pp2_vpp2_variable_lengths_batched_equals_pp1_over_20_iterations(data):
    # Same data on both: one document per sample, so microbatches differ in length.
    iterations = ["--train-iters", "20", "--variable-seq-lengths"]
    reference = losses(run(1, small_gpt(data, *iterations)))
    pipelined = losses(run(2, small_gpt(data, *iterations, *PP2_VPP2)))
    assert sorted(reference) == list(range(1, 21)) == sorted(pipelined)
    for iteration in reference:
        assert pipelined[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration
    assert reference[20] < reference[1] - 1.0  # and it learns


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return found


def test_sigterm_saves_and_resume_continues_the_same_curve(data, tmp_path):
    base = small_gpt(data, "--train-iters", "12", *PP2_VPP2)
    uninterrupted = losses(run(2, base))

    save = ["--save", str(tmp_path), "--exit-signal-handler"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", PRETRAIN, *base, *save]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    output, deadline = [], time.monotonic() + 240
    try:
        for line in proc.stdout:
            output.append(line)
            match = LOSS.search(line)
            if match and int(match.group(1)) >= 4:
                for worker in _children(proc.pid):
                    os.kill(worker, signal.SIGTERM)
                break
            assert time.monotonic() < deadline, "".join(output)
        output.append(proc.communicate(timeout=120)[0])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(output)
    assert proc.returncode == 0, text[-4000:]
    assert "exiting program after receiving SIGTERM." in text
    stopped = max(losses(text))
    assert 4 <= stopped < 12
    assert open(tmp_path / "latest_checkpointed_iteration.txt").read() == str(stopped)

    resumed = losses(run(2, base + ["--load", str(tmp_path)]))
    assert sorted(resumed) == list(range(stopped + 1, 13))
    for iteration, value in resumed.items():
        assert value == pytest.approx(uninterrupted[iteration], rel=1e-6), iteration


def test_checkpoint_from_pp2_vpp2_loads_at_pp1_and_pp4(data, tmp_path):
    train = small_gpt(data, "--train-iters", "3", "--save", str(tmp_path), *PP2_VPP2)
    saved = float(TEST_LOSS.search(run(2, train)).group(1))
    for nproc, layout in ((1, []), (4, ["--pipeline-model-parallel-size", "4"])):
        args = small_gpt(data, "--train-iters", "3", "--load", str(tmp_path), "--no-load-optim",
                         "--variable-seq-lengths", *layout)  # the same evaluation data
        output = run(nproc, args)
        assert "loaded checkpoint" in output
        assert float(TEST_LOSS.search(output).group(1)) == pytest.approx(saved, rel=1e-5)


@pytest.mark.parametrize("nproc,extra,message", [
    (2, ["--num-experts", "8", "--use-torch-fsdp2"],
     "--use-torch-fsdp2: not available in this tree"),
    (2, ["--tensor-model-parallel-size", "4"], "is not divisible by --tensor-model-parallel-size 4"),
])
def test_bad_input_fails_in_seconds_with_the_flag_named(nproc, extra, message, data):
    started = time.monotonic()
    result = run_torchrun(PRETRAIN, nproc, args=small_gpt(data, "--train-iters", "2", *extra),
                          timeout_s=60)
    assert result.returncode != 0
    assert "error: " in result.stdout and message in result.stdout
    # One line from the ranks, no traceback (torchrun's own report of the exit code follows).
    assert not re.search(r"\[rank\d+\]: Traceback", result.stdout), result.stdout[-3000:]
    assert time.monotonic() - started < 30


def test_missing_data_path_is_named(data):
    args = [a for a in small_gpt(data, "--train-iters", "2")]
    index = args.index("--data-path")
    del args[index:index + 2]
    result = run_torchrun(PRETRAIN, 1, args=args, timeout_s=60)
    assert result.returncode != 0
    assert "pretraining needs --data-path" in result.stdout


def test_missing_logging_packages_warn_once_and_training_goes_on(data, tmp_path):
    # Where tensorboard and wandb are not installed: an importable stand-in that fails.
    for package in ("tensorboard", "wandb"):
        (tmp_path / f"{package}.py").write_text(f"raise ModuleNotFoundError('no {package}')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    args = small_gpt(data, "--train-iters", "3", "--eval-iters", "0",
                     "--tensorboard-dir", str(tmp_path / "tb"),
                     "--wandb-project", "p", "--wandb-exp-name", "r")
    result = run_torchrun(PRETRAIN, 1, args=args, timeout_s=120, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("WARNING: --tensorboard-dir") == 1
    assert result.stdout.count("WARNING: --wandb-project") == 1
    # Decided at start-up, before the model is built.
    assert result.stdout.index("WARNING: --tensorboard-dir") < \
        result.stdout.index("number of parameters")
    assert sorted(losses(result.stdout)) == [1, 2, 3]


@pytest.mark.parametrize("extra,samples", [([], 16), (["--eval-global-batch-size", "4"], 8)])
def test_evaluation_runs_batches_of_eval_global_batch_size(extra, samples, data):
    # Global batch 8 (micro-batch 2, dp 1 at pp 2): 2 evaluation iterations of 8 or of 4.
    output = run(2, small_gpt(data, "--train-iters", "3", "--eval-interval", "3", "--eval-iters",
                              "2", "--pipeline-model-parallel-size", "2", *extra))
    assert output.count(f"Evaluating on {samples} samples") == 2  # validation and test
    assert "validation loss at iteration 3 on test set" in output
