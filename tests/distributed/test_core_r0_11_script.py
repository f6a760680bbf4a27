"""A script written for megatron.core 0.11's pipeline API runs unchanged and is exact.

Run as torchrun's workers run it (``run_script``): pp 2 and 4, interleaved, variable sequence
lengths, batched p2p (upstream's default) -- the combinations upstream hangs, crashes or
corrupts on.
"""

import json
import os
import re

import pytest

from tests.launcher import run_script

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "core_r0_11_pipeline.py")


@pytest.mark.parametrize("pp,extra", [
    (2, ["--vpp", "2", "--variable-seq-lengths"]),
    (4, ["--vpp", "2", "--variable-seq-lengths"]),
    (2, ["--vpp", "2"]),
    (4, ["--variable-seq-lengths", "--no-batch-p2p-comm"]),
])
def test_core_r0_11_style_script_matches_reference(pp, extra):
    result = run_script(SCRIPT, pp, args=extra, timeout_s=120)
    assert result.returncode == 0, result.stdout
    reports = [json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", result.stdout)]
    assert sorted(r["rank"] for r in reports) == list(range(pp)), result.stdout
    assert max(r["worst"] for r in reports) <= 1e-6, reports
