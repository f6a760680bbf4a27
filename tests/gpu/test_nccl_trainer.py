"""pretrain_gpt.py end to end over NCCL, several ranks on one GPU, against one rank's losses.

The small GPT of ``tests/distributed/test_trainer.py`` (fp32, no dropout, CPU initialisation, so
every layout starts from the same weights) trained for 12 iterations at pp 2 x vpp 2 with
variable lengths and batched p2p, pp 4, tp 2 x pp 2 x vpp 2 with variable lengths and sequence
parallelism (overlapped p2p), dp 2 with the distributed optimizer, and context parallelism
(with tp 2 and sequence parallelism; with pp 2 and the distributed optimizer over cp); every
loss is compared with the same flags on one process. Then both ``examples/gpt3_7b`` scripts,
scaled down, on four one-GPU "nodes" that each start torchrun themselves, as on a cluster.
"""

import os
import sys

import pytest

from tests.distributed.test_trainer import PP2_VPP2, TEST_LOSS, losses, small_gpt
from tests.gpu.nccl_support import BACKEND, REPO, launch, needs, torchrun_on_path

pytestmark = needs(BACKEND)

PRETRAIN = REPO / "pretrain_gpt.py"
ITERATIONS = 12
# Relative, per iteration. The layouts sum the same fp32 numbers in another order (tensor-
# parallel partial products, data-parallel gradient halves, another microbatch split) and TF32
# is off (torch's default; NVIDIA_TF32_OVERRIDE=0 too). Measured on an H200 over 12 iterations
# with equal lengths: pp 4, dp 2, pp 2 x vpp 2 and tp 2 x pp 2 x vpp 2 (sequence parallel) were
# bitwise equal to one rank, tp 2 x dp 2 within 1.8e-7; gloo on CPU within 1.9e-7 for all four
# layouts here. The bound leaves room for variable lengths' padded shapes picking other
# kernels; a wrong gradient anywhere moves the loss by orders of magnitude more.
RTOL = 5e-5
DEADLINE_S = 300

LAYOUTS = {
    "pp2-vpp2-variable-batched": (2, PP2_VPP2),
    "pp4": (4, ["--pipeline-model-parallel-size", "4"]),
    "tp2-pp2-vpp2-variable-sequence-parallel": (
        4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
            "--variable-seq-lengths"]),
    "dp2-distributed-optimizer": (2, ["--use-distributed-optimizer"]),
    "tp2-cp2-sequence-parallel": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--context-parallel-size", "2"]),
    "pp2-cp2-distributed-optimizer": (4, ["--pipeline-model-parallel-size", "2",
                                          "--context-parallel-size", "2",
                                          "--use-distributed-optimizer"]),
}


def nccl_gpt(data, *extra):
    # Every length as it comes (not bucketed, as by default on GPUs): the pipeline must carry
    # each one.
    args = small_gpt(data, "--train-iters", str(ITERATIONS), "--variable-seq-length-multiple",
                     "1", *extra)
    args[args.index("--distributed-backend") + 1] = BACKEND
    return args


def train(nproc: int, args, log_dir) -> dict[int, float]:
    launched = launch([sys.executable, str(PRETRAIN), *args], nproc, timeout_s=DEADLINE_S,
                      log_dir=log_dir)
    assert launched.ok, launched.describe()
    found = losses(launched.combined)
    assert sorted(found) == list(range(1, ITERATIONS + 1)), launched.describe()
    return found


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """One process's losses, with and without --variable-seq-lengths (it changes the data)."""
    cache = {}

    def get(variable: bool) -> dict[int, float]:
        if variable not in cache:
            extra = ["--variable-seq-lengths"] if variable else []
            cache[variable] = train(1, nccl_gpt(data, *extra), tmp_path_factory.mktemp("ref"))
        return cache[variable]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_rank_over_nccl(layout, data, reference, tmp_path):
    nproc, flags = LAYOUTS[layout]
    want = reference("--variable-seq-lengths" in flags)
    got = train(nproc, nccl_gpt(data, *flags), tmp_path)
    worst = max(abs(got[i] - want[i]) / abs(want[i]) for i in want)
    print(f"{layout} over {BACKEND}: largest relative loss difference {worst:.2e} "
          f"(losses {want[1]:.4f} -> {want[ITERATIONS]:.4f})")
    for iteration in want:
        assert got[iteration] == pytest.approx(want[iteration], rel=RTOL), iteration
    assert want[ITERATIONS] < want[1] - 0.5  # and it learns


@pytest.mark.parametrize("script", ["train_gpt3_7b_pp4.sh", "train_gpt3_7b_pp2_vpp2.sh"])
def test_gpt3_7b_example_scaled_down_on_four_nodes(script, data, tmp_path):
    env = {**torchrun_on_path(tmp_path / "bin"), "NUM_LAYERS": "4", "TRAIN_ITERS": "3",
           "GLOBAL_BATCH_SIZE": "8", "TRANSFORMER_IMPL": "local"}
    command = ["bash", str(REPO / "examples" / "gpt3_7b" / script),
               str(tmp_path / "ckpt"), str(tmp_path / "tb"), str(data / "corpus_text_document"),
               str(data / "tokenizer.model"), "--hidden-size", "64", "--num-attention-heads", "4",
               "--seq-length", "64", "--max-position-embeddings", "64",
               "--distributed-backend", BACKEND, "--eval-iters", "1", "--num-workers", "0",
               "--initial-loss-scale", "4096"]
    launched = launch(command, 4, as_nodes=True, timeout_s=DEADLINE_S, extra_env=env,
                      log_dir=tmp_path / "logs")
    assert launched.ok, launched.describe()
    output = launched.combined
    assert "iteration        3/       3" in output, launched.describe()
    assert TEST_LOSS.search(output), launched.describe()
    assert os.path.isfile(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt")
    assert os.listdir(tmp_path / "tb")  # TensorBoard events from the last rank
