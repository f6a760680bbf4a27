"""Fixtures the GPU tests share."""

import subprocess
import sys

import pytest

from tests.gpu.nccl_support import REPO


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The quickstart corpus and tokenizer (tools/make_quickstart_data.py)."""
    out = tmp_path_factory.mktemp("quickstart-data")
    subprocess.run([sys.executable, str(REPO / "tools" / "make_quickstart_data.py"), str(out)],
                   check=True, capture_output=True, timeout=180)
    return out
