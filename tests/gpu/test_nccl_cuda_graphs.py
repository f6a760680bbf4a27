"""``--enable-cuda-graph`` over NCCL, several ranks on one GPU: each layout trains with its
layers replayed from CUDA graphs as it does eagerly with the same flags (12 iterations of the
small GPT of ``test_nccl_trainer``; the first microbatch of each length runs eagerly, the
next is captured, later ones replay, so eager and replayed microbatches mix within steps).

Covered: one rank in fp32 and with FP8 (``--fp8-format hybrid``: the compiled casts and
``torch._scaled_mm`` under capture; with ``--fp8-recipe delayed`` the amax histories each
replay moves on); pp 2 x vpp 2 with variable lengths (several runners per
layer in flight, one per shape); tp 2 with sequence parallelism and dropout (collectives and
the default generator's Philox offsets under capture), and without sequence parallelism
(attention dropout forks the graph-safe tracker's stream inside the graph); dp 2 with overlapped gradient
reduction and the distributed optimizer (the data-parallel hooks fired by replayed
backwards). ``GPU_TESTS_BACKEND=gloo`` runs the same comparison on CPU, where the replay
re-runs the captured function.
"""

import pytest

from tests.distributed.test_trainer import PP2_VPP2
from tests.gpu.nccl_support import BACKEND, needs
from tests.gpu.test_nccl_trainer import RTOL, nccl_gpt, train

pytestmark = needs(BACKEND)

GRAPHS = ["--enable-cuda-graph", "--cuda-graph-warmup-steps", "1"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]

LAYOUTS = {
    "one-rank": (1, []),
    "one-rank-fp8": (1, ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]),
    "one-rank-fp8-delayed": (1, ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                                 "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo",
                                 "max"]),
    "pp2-vpp2-variable-batched": (2, PP2_VPP2),
    "tp2-sequence-parallel-dropout": (2, ["--tensor-model-parallel-size", "2",
                                          "--sequence-parallel", *DROPOUT]),
    "tp2-dropout": (2, ["--tensor-model-parallel-size", "2", *DROPOUT]),
    "dp2-overlapped-distributed-optimizer": (2, ["--use-distributed-optimizer",
                                                 "--overlap-grad-reduce"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replayed_layers_train_as_eager_ones(layout, data, tmp_path):
    nproc, flags = LAYOUTS[layout]
    if "--fp8-format" in flags:
        pytest.importorskip("torchao")
    # The dropout flags must come after small_gpt's zeros to win.
    eager = train(nproc, nccl_gpt(data, *flags), tmp_path / "eager")
    graphed = train(nproc, nccl_gpt(data, *flags, *GRAPHS), tmp_path / "graphed")
    worst = max(abs(graphed[i] - eager[i]) / abs(eager[i]) for i in eager)
    print(f"cuda graphs {layout} over {BACKEND}: largest relative loss difference to eager "
          f"{worst:.2e}")
    for iteration in eager:
        assert graphed[iteration] == pytest.approx(eager[iteration], rel=RTOL), iteration
