"""Checkpoints written by real Megatron-LM core_v0.11.0 resume here with upstream's losses.

The fixtures in ``tests/data/upstream_core_v0_11/golden`` were saved on one GPU by upstream's
``pretrain_gpt.py`` (``make_golden_fixtures.py``: ``torch_dist`` and legacy ``torch``, the plain
optimizer at pp 2 and the distributed one at dp 2, iteration 4 of 8), with the losses of
iterations 5-8 of upstream's run that did not stop (its own resume gives those with the plain
optimizer; with the distributed one under torch's Adam it departs from them, by 5.6e-3 measured
on 2026-12-04, which this tree does not). Here ``pretrain_gpt.py --load`` resumes each on
CPU/gloo at the same layout with the same flags and corpus, and must get those losses.

Tolerance: fp32 on both sides, but a GPU and a CPU sum matrix products and reductions in other
orders (cuBLAS tiles against oneDNN/ATen blocks), each order exact to fp32 rounding (~6e-8
relative per operation, ~1e-6 over a dot product of this model's widths); Adam divides updates by
the running gradient scale, so such differences stay at the rounding level through four steps
instead of growing with the learning rate: ``RTOL`` = 5e-5 leaves an order of magnitude above
them, while a lost or wrong optimizer state moves the first resumed loss by 1e-3 or more. The
RNG states restore too: Python's, NumPy's and the CPU generator's exactly (checked below); the
GPU generators' states cannot drive CPU generators and are left as seeded (no dropout here).
"""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch

from megatron.training.checkpoint.rng_state import restore_rng_state
from megatron.training.checkpoint.upstream_dist import DistSource
from tests.distributed.test_trainer import PRETRAIN, losses
from tests.gpu.nccl_support import REPO
from tests.launcher import run_script
from tests.upstream.real_upstream import LAYOUTS, relative_difference
from tests.upstream.tiny_corpus import data_flags

GOLDEN = REPO / "tests" / "data" / "upstream_core_v0_11" / "golden"
FIXTURES = ["torch_dist-plain", "torch_dist-distributed", "torch-plain", "torch-distributed"]
RTOL = 5e-5
DEADLINE_S = 300


def golden() -> dict:
    record = GOLDEN / "golden.json"
    if not record.is_file():
        pytest.skip(f"no golden fixtures yet: {GOLDEN.relative_to(REPO)} is written on a GPU by "
                    f"'python -m tests.upstream.make_golden_fixtures DIR' (DIR/golden)")
    return json.loads(record.read_text())


@pytest.mark.parametrize("name", FIXTURES)
def test_resuming_upstreams_checkpoint_gives_upstreams_losses(name, tmp_path):
    record = golden()
    fixture = record["fixtures"][name]
    checkpoint = shutil.copytree(GOLDEN / name, tmp_path / "checkpoint")
    args = [*record["model_flags"], *data_flags(GOLDEN / record["corpus"], tmp_path / "cache"),
            *record["layouts"][name], *record["optimizer_flags"][fixture["optimizer"]],
            "--ckpt-format", fixture["format"], "--load", str(checkpoint),
            "--distributed-backend", "gloo"]
    done = run_script(PRETRAIN, LAYOUTS[fixture["layout"]].ranks, args=args,
                        timeout_s=DEADLINE_S)
    assert done.returncode == 0, done.stdout[-4000:]
    found = losses(done.stdout)
    expected = {int(k): v for k, v in fixture["uninterrupted_losses"].items()
                if int(k) > fixture["saved_at"]}
    assert sorted(found) == sorted(expected), done.stdout[-4000:]
    worst = relative_difference(found, expected)
    print(f"{name}: largest relative difference to upstream's run without a stop {worst:.2e}")
    assert worst <= RTOL, f"here {found}, upstream {expected}"


@pytest.fixture
def keep_generators():
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


def test_upstreams_rng_states_restore_here(keep_generators):
    record = golden()
    name = "torch_dist-plain"
    source = DistSource(str(GOLDEN / name / f"iter_{record['fixtures'][name]['saved_at']:07d}"))
    for stage in range(int(source.args["pipeline_model_parallel_size"])):
        saved = source.rng_states(stage, 0)
        restore_rng_state(saved, False, name)
        assert random.getstate() == saved[0]["random_rng_state"]
        numpy_state = np.random.get_state()
        assert numpy_state[0] == saved[0]["np_rng_state"][0]
        assert (numpy_state[1] == saved[0]["np_rng_state"][1]).all()
        assert numpy_state[2:] == saved[0]["np_rng_state"][2:]
        assert torch.equal(torch.get_rng_state(), saved[0]["torch_rng_state"])
