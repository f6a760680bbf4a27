"""``--save --ckpt-format torch`` (upstream's legacy per-rank files) from ``pretrain_gpt.py`` on
CPU/gloo, and ``--load`` of them.

Saved at tp 2 x pp 2 with the plain optimizer (fp32) and at pp 2 x vpp 2 x dp 2 with the
distributed optimizer (bf16): the files are upstream's (``mp_rank_TT_PPP/model_optim_rng.pt``
from the first data-parallel rank, ``distrib_optim.pt`` beside it for the distributed
optimizer; args, checkpoint_version 3.0, model or model0/model1, optimizer, scheduler, rerun
state, RNG states, floating-point operations). A run resumed at the same layout gives the
uninterrupted run's losses bit for bit, with dropout on (so the RNG states came back); at
another layout, optimizer included, within the cross-layout tolerance of fp32 (another
reduction order). A layout whose distributed-optimizer buffers upstream itself cannot build
(the tied embedding straddling two buckets) stops at the save in one line. A crafted
``model_optim_rng.pt`` given to ``--load`` ends the run with exit code 2 and one line naming
the file, without running the command it holds.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron.training.checkpoint import integrity
from tests.distributed.test_trainer import PRETRAIN, data, losses, run, small_gpt  # noqa: F401
from tests.launcher import free_port, run_script

LAYOUTS = {
    "tp2-pp2-fp32": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "pp2-vpp2-dp2-distributed-bf16": ["--pipeline-model-parallel-size", "2",
                                      "--num-layers-per-virtual-pipeline-stage", "2",
                                      "--use-distributed-optimizer", "--bf16"],
    "pp2-vpp2-dp2-distributed-fp32": ["--pipeline-model-parallel-size", "2",
                                      "--num-layers-per-virtual-pipeline-stage", "2",
                                      "--use-distributed-optimizer"],
}
CROSS_LAYOUT_TOLERANCE = 1e-5
TORCH = ["--ckpt-format", "torch"]


def _args(data, layout: str, *extra, dropout: bool = False) -> list[str]:
    args = small_gpt(data, "--train-iters", "8", *LAYOUTS[layout], *extra)
    if dropout:  # small_gpt's "--hidden-dropout 0 --attention-dropout 0" out: the defaults
        at = args.index("--hidden-dropout")
        del args[at:at + 4]
    return args


def _saved(root) -> dict:
    return torch.load(root / "iter_0000004" / "mp_rank_00_001" / "model_optim_rng.pt",
                      weights_only=False)


@pytest.mark.parametrize("layout", ["tp2-pp2-fp32", "pp2-vpp2-dp2-distributed-bf16"])
def test_torch_format_resumes_bit_for_bit_at_the_same_layout(layout, data, tmp_path):
    uninterrupted = losses(run(4, _args(data, layout, "--save", str(tmp_path), "--save-interval",
                                        "4", *TORCH, dropout=True)))
    folder = tmp_path / "iter_0000004"
    assert sorted(os.listdir(folder)) == ["manifest.json"] + [
        f"mp_rank_0{t}_00{p}" for t in range(2 if layout.startswith("tp2") else 1)
        for p in range(2)]
    state = _saved(tmp_path)
    distributed = "distributed" in layout
    assert (folder / "mp_rank_00_001" / "distrib_optim.pt").is_file() == distributed
    assert list(state) == ["args", "checkpoint_version", "iteration"] + (
        ["model0", "model1"] if distributed else ["model"]) + [
        "optimizer", "opt_param_scheduler", "rerun_state_machine", "rng_state",
        "num_floating_point_operations_so_far"]
    args = state["args"]
    assert (state["checkpoint_version"], state["iteration"], args.consumed_train_samples) == (
        3.0, 4, 32)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.num_layers, args.hidden_size) == ((1 if distributed else 2), 2, 8, 64)
    # On CPU there is no CUDA generator to save (upstream's key for it is left out).
    assert sorted(state["rng_state"][0]) == ["np_rng_state", "random_rng_state",
                                             "rng_tracker_states", "torch_rng_state"]
    output = run(4, _args(data, layout, "--load", str(tmp_path), "--ckpt-step", "4",
                          dropout=True))
    assert "(model weights, optimizer state and scheduler)" in output
    resumed = losses(output)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert resumed == {i: uninterrupted[i] for i in resumed}


@pytest.mark.parametrize("source,target", [
    ("tp2-pp2-fp32", "pp2-vpp2-dp2-distributed-fp32"),
    pytest.param("pp2-vpp2-dp2-distributed-fp32", "tp2-pp2-fp32", marks=pytest.mark.slow),
])
def test_torch_format_resumes_at_another_layout(source, target, data, tmp_path):
    uninterrupted = losses(run(4, _args(data, source, "--save", str(tmp_path), "--save-interval",
                                        "4", *TORCH)))
    output = run(4, _args(data, target, "--load", str(tmp_path), "--ckpt-step", "4"))
    assert "RNG state will be ignored" in output
    assert "(model weights, optimizer state and scheduler)" in output
    other = losses(output)
    assert sorted(other) == [5, 6, 7, 8]
    for iteration, value in other.items():
        assert value == pytest.approx(uninterrupted[iteration], rel=CROSS_LAYOUT_TOLERANCE), \
            iteration


def test_a_layout_upstream_cannot_hold_stops_at_the_save_in_one_line(data, tmp_path):
    # Buckets of 20000 elements put the tied embedding's start mid-bucket: upstream's own
    # distributed optimizer stops with an assertion there.
    result = run_script(PRETRAIN, 4, timeout_s=240, args=_args(
        data, "pp2-vpp2-dp2-distributed-fp32", "--overlap-grad-reduce", "--ddp-bucket-size",
        "20000", "--save", str(tmp_path), "--save-interval", "1", *TORCH))
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and errors, result.stdout[-3000:]
    assert "--ckpt-format torch: embedding.word_embeddings.weight straddles" in errors[0]
    assert "save with --ckpt-format torch_dist or layout_free" in errors[0]
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()


class RunsCommand:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _pretrain_alone(args: list[str]) -> subprocess.CompletedProcess:
    """``pretrain_gpt.py`` as one process (its own exit code, no torchrun in between)."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, PRETRAIN, *args], capture_output=True, text=True,
                          env=env, timeout=240)


def test_a_crafted_checkpoint_given_to_load_runs_nothing(data, tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "marker"
    saved = _pretrain_alone(small_gpt(data, "--train-iters", "3", "--save", str(root), *TORCH))
    assert saved.returncode == 0, saved.stdout[-2000:] + saved.stderr[-2000:]
    file = root / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(file, weights_only=False)
    state["args"].crafted = RunsCommand(str(marker))
    torch.save(state, file)
    # The manifest made to match, as whoever crafted the file would.
    manifest = json.loads((root / "iter_0000003" / "manifest.json").read_text())
    manifest["files"]["mp_rank_00/model_optim_rng.pt"] = integrity.file_digest(str(file))
    (root / "iter_0000003" / "manifest.json").write_text(json.dumps(manifest))
    loaded = _pretrain_alone(small_gpt(data, "--train-iters", "4", "--load", str(root)))
    assert loaded.returncode == 2, loaded.stdout[-2000:] + loaded.stderr[-2000:]
    errors = [line for line in loaded.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(file) in errors[0] and "system" in errors[0], loaded.stderr
    assert "Traceback" not in loaded.stderr
    assert not marker.exists()
