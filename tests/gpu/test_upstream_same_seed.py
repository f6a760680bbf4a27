"""Same-seed parity with real upstream: from scratch, one rank, fp32, the first 8 losses agree.

Upstream Megatron-LM's own ``pretrain_gpt.py`` (a core_v0.11.0 checkout named by
``MEGATRON_LM_TREE``, copied to a temporary folder because its dataset helpers compile into
it on first use; skipped without it) and this tree's are started with ``torchrun
--nproc-per-node 1`` and the same flags: the quickstart corpus and tokenizer, no dropout.
Identical initial weights and identical data order must give the same loss at every
iteration, within 1e-5 relative: attention, softmax and Adam are different code in the two
trees, fp32 throughout, TF32 off. With ``--use-cpu-initialization`` the weights' equality is
proven on the CPU (``tests/upstream/test_init_parity.py``); on the GPU path both trees draw the
tensor-parallel weights from the model-parallel tracker seeded ``seed + 2718`` in the same order
and the position embeddings from the CPU generator, so they are expected equal too.

Upstream runs on torch >= 2.6 as released, with only its fused kernels turned off (they need
apex or Transformer Engine) and ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which its argument checks
ask for; its process sees only the checkout and the packages of ``upstream_tree``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.distributed.test_trainer import losses
from tests.gpu.nccl_support import DETERMINISTIC_ENV, REPO
from tests.launcher import run_torchrun
from tests.upstream.upstream_tree import upstream_python_path

pytestmark = [pytest.mark.cuda, pytest.mark.upstream]

ITERATIONS = 8
RTOL = 1e-5
DEADLINE_S = 480
# A line only upstream's start-up prints: the losses below are upstream's own.
UPSTREAM_MARK = "> initialized tensor model parallel with size 1"


def flags(data, cache, init: str) -> list[str]:
    where = ["--use-cpu-initialization"] if init == "cpu" else []
    return ["--transformer-impl", "local", *where, "--seed", "1234",
            "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters",
            str(ITERATIONS), "--lr", "3e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters",
            "2", "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta2", "0.95",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
            "--num-workers", "0", "--data-path", str(data / "corpus_text_document"),
            "--split", "949,50,1", "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
            str(data / "tokenizer.model"), "--data-cache-path", str(cache),
            "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
            "--no-bias-dropout-fusion", "--no-bias-gelu-fusion", "--no-persist-layer-norm"]


def train(script, args, env) -> tuple[dict[int, float], str]:
    """The loss of every iteration, and the output."""
    done = run_torchrun(str(script), 1, args=args, timeout_s=DEADLINE_S,
                        env={**DETERMINISTIC_ENV, **env})
    assert done.returncode == 0, done.stdout[-4000:]
    found = losses(done.stdout)
    assert sorted(found) == list(range(1, ITERATIONS + 1)), done.stdout[-4000:]
    return found, done.stdout


@pytest.mark.parametrize("init", ["cpu", "gpu"])
def test_first_losses_equal_upstreams_from_the_same_seed(init, data, tmp_path):
    tree, *packages = upstream_python_path(tmp_path / "upstream-packages")
    copy = tmp_path / "upstream"
    shutil.copytree(tree / "megatron", copy / "megatron")
    shutil.copy(tree / "pretrain_gpt.py", copy)
    theirs, log = train(copy / "pretrain_gpt.py", flags(data, tmp_path / "upstream-cache", init),
                        {"PYTHONPATH": os.pathsep.join(map(str, [copy, *packages])),
                         "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert UPSTREAM_MARK in log
    ours, _ = train(REPO / "pretrain_gpt.py", flags(data, tmp_path / "cache", init),
                    {"PYTHONPATH": str(REPO)})
    for iteration in range(1, ITERATIONS + 1):  # -rA shows the figures of a passing run
        print(f"iteration {iteration}: ours {ours[iteration]:.7e}, upstream "
              f"{theirs[iteration]:.7e}, relative "
              f"{abs(ours[iteration] - theirs[iteration]) / abs(theirs[iteration]):.1e}")
    for iteration in range(1, ITERATIONS + 1):
        assert ours[iteration] == pytest.approx(theirs[iteration], rel=RTOL), (
            f"iteration {iteration}: ours {ours[iteration]!r}, upstream {theirs[iteration]!r}")
