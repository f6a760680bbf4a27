"""Upstream's own GPT CI configurations and its 175B example, scaled down, over NCCL on one GPU.

The cases of tests/distributed/test_upstream_configs.py, with ``--distributed-backend nccl`` and
each configuration's environment (``NCCL_ALGO`` for ``--deterministic-mode``, ...): every rank is
its own process posing as a one-GPU host (``tools/launch_nccl_ranks.py``), up to 8 of them.
``GPU_TESTS_BACKEND=gloo`` dry-runs the launch and checks on CPU.
"""

from __future__ import annotations

import sys

import pytest

from tests.distributed.test_upstream_configs import check_log
from tests.distributed.upstream_config_cases import REPRESENTATIVE, scaled_down
from tests.gpu.nccl_support import BACKEND, REPO, launch, needs

pytestmark = needs(BACKEND)


@pytest.mark.parametrize("case", sorted(REPRESENTATIVE))
def test_upstream_ci_configuration_scaled_down_trains_over_nccl(case, data, tmp_path):
    run = scaled_down(*REPRESENTATIVE[case], data=data, out=tmp_path,
                      backend=BACKEND)
    launched = launch([sys.executable, str(REPO / "pretrain_gpt.py"), *run.argv],
                      run.world_size, timeout_s=420, log_dir=tmp_path / "logs",
                      extra_env=run.env)
    assert launched.ok, launched.describe()
    check_log(case, launched.output(run.world_size - 1))
