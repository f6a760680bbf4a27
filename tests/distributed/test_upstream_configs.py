"""Upstream Megatron-LM's own GPT CI configurations and its examples/gpt3 175B flag set, scaled
down, train through pretrain_gpt.py on CPU/gloo (see upstream_config_cases.py for what is scaled
and what each adds).

The same cases run over NCCL on one GPU in tests/gpu/test_nccl_upstream_configs.py.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.distributed.upstream_config_cases import REPRESENTATIVE, scaled_down
from tests.launcher import run_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")
LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.* global batch size:\s+(\d+) \|"
                  r".* lm loss: ([0-9.E+-]+) \|")
# What each configuration's log line must show besides the loss (upstream's wording).
EXPECTED = {
    "tp1_pp4_vp1_decoupled_lr": ["decoupled learning rate:"],
    "15b_release_rampup_samples": ["params norm:", "num zeros:"],
    "main_15b_release_step_schedule": ["params norm:", "num zeros:"],
}
# What it must not show: upstream's amax flags reach delayed scaling, the default recipe (the
# warning names flags a recipe leaves unused).
UNEXPECTED = {"tp2_pp2_fp8_sequence_parallel": ["does not use them"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("quickstart-data")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "make_quickstart_data.py"),
                    str(out)], check=True, capture_output=True, timeout=120)
    return out


def train(case: str, data, out, backend: str = "gloo"):
    run = scaled_down(*REPRESENTATIVE[case], data=data, out=out, backend=backend)
    result = run_script(PRETRAIN, run.world_size, args=run.argv, timeout_s=420, env=run.env)
    assert result.returncode == 0, result.stdout[-5000:]
    return result.stdout


def check_log(case: str, output: str) -> None:
    lines = LINE.findall(output)
    assert lines, output[-3000:]
    assert all(math.isfinite(float(loss)) for *_, loss in lines)
    for text in EXPECTED.get(case, []):
        assert text in output, f"{case}: no {text!r} in the log"
    for text in UNEXPECTED.get(case, []):
        assert text not in output, f"{case}: {text!r} in the log"
    if case != "gpt3_175b_example":  # every CI configuration logs them
        assert "params norm:" in output and "num zeros:" in output
    if case in ("15b_release_rampup_samples", "gpt3_175b_example",
                "main_15b_release_step_schedule"):
        batches = [int(batch) for _, _, batch, _ in lines]
        assert batches[0] < batches[-1] and batches == sorted(batches)  # the ramp


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REPRESENTATIVE))
def test_upstream_ci_configuration_scaled_down_trains(case, data, tmp_path):
    check_log(case, train(case, data, tmp_path))
    if case.startswith("main_"):  # its save, loaded again under its own checkpoint flags
        again = train(case, data, tmp_path)
        assert "loaded upstream torch_dist checkpoint" in again or \
            "loaded checkpoint from" in again, again[-3000:]
        assert "do not match" not in again
