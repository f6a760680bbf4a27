"""pretrain_gpt.py on CPU/gloo with the pipeline-split and deferral flags: the loss curve of an
uneven or slot-counted split, with the output layer's weight gradients deferred and the
data-parallel reduction overlapped, equals the unpipelined run's."""

import os
import subprocess
import sys

import pytest

from tests.distributed.test_trainer import REPO, losses, run, small_gpt

ITERATIONS = ["--num-layers", "6", "--train-iters", "6"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart-data")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_quickstart_data.py"),
                    str(out)], check=True, capture_output=True, timeout=120)
    return out


@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
     "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
     "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "2", "--overlap-grad-reduce"],
    ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
     "--defer-embedding-wgrad-compute", "--untie-embeddings-and-output-weights"],
], ids=["vpp2-embedding-loss-slots-deferred-overlapped", "first2-deferred-untied"])
def test_split_and_deferral_follow_the_unpipelined_curve(data, layout):
    untied = [flag for flag in layout if flag == "--untie-embeddings-and-output-weights"]
    reference = losses(run(1, small_gpt(data, *ITERATIONS, *untied)))
    pipelined = losses(run(2, small_gpt(data, *ITERATIONS, *layout)))
    assert sorted(reference) == list(range(1, 7)) == sorted(pipelined)
    for iteration in reference:
        assert pipelined[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration
