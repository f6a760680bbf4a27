"""``--enable-cuda-graph`` through pretrain_gpt.py on gloo: with the layers' graphs replayed
by re-running them (no CUDA device), the trainer's losses equal the eager run's bit for bit at
pp 2 x vpp 2 with variable lengths (a runner per shape and microbatch in flight), tp 2 with
dropout (with and without sequence parallelism), and dp 2 with overlapped gradient reduction and the
distributed optimizer. The same cases over NCCL with real graphs:
``tests/gpu/test_nccl_cuda_graphs.py``."""

import pytest

from tests.distributed.test_trainer import PP2_VPP2, data, losses, run, small_gpt  # noqa: F401

GRAPHS = ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]

LAYOUTS = {
    "pp2-vpp2-variable": (2, PP2_VPP2),
    "tp2-sequence-parallel-dropout": (2, ["--tensor-model-parallel-size", "2",
                                          "--sequence-parallel", "--hidden-dropout", "0.1",
                                          "--attention-dropout", "0.1"]),
    "tp2-dropout": (2, ["--tensor-model-parallel-size", "2", "--hidden-dropout", "0.1",
                        "--attention-dropout", "0.1"]),
    "dp2-overlapped-distributed-optimizer": (2, ["--use-distributed-optimizer",
                                                 "--overlap-grad-reduce"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_with_replayed_layers_equals_eager(layout, data):  # noqa: F811
    nproc, flags = LAYOUTS[layout]
    args = small_gpt(data, "--train-iters", "5", *flags)
    eager = losses(run(nproc, args))
    assert losses(run(nproc, args + GRAPHS)) == eager
    assert sorted(eager) == [1, 2, 3, 4, 5]

