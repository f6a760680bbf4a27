"""Where tests find real upstream Megatron-LM: a checkout named by ``MEGATRON_LM_TREE``.

The checkout (``git archive core_v0.11.0 megatron pretrain_gpt.py`` of github.com/NVIDIA/
Megatron-LM, never committed here) runs in processes whose ``PYTHONPATH`` holds only it and,
where this interpreter lacks some of the few pip packages it imports, a folder holding them:
``MEGATRON_LM_PACKAGES`` when set (for machines without a package registry, e.g. made with
``pip install --target DIR six regex einops pybind11``), else a temporary ``pip install
--target``. Tests skip without the checkout or the packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TREE_VARIABLE = "MEGATRON_LM_TREE"
PACKAGES_VARIABLE = "MEGATRON_LM_PACKAGES"
# What upstream's argument parser imports (pybind11: its dataset helpers' build; psutil: its
# torch_dist checkpoint strategy).
PACKAGES = ("six", "regex", "einops", "pybind11", "psutil")


def upstream_tree() -> Path:
    """The checkout, or a skip naming the variable."""
    tree = os.environ.get(TREE_VARIABLE)
    if not tree:
        pytest.skip(f"set {TREE_VARIABLE} to a Megatron-LM core_v0.11.0 checkout")
    if not (Path(tree) / "pretrain_gpt.py").is_file():
        pytest.fail(f"{TREE_VARIABLE}={tree} holds no pretrain_gpt.py")
    return Path(tree)


def upstream_python_path(target: Path) -> list[Path]:
    """``PYTHONPATH`` of an upstream process: the checkout, then a folder of the packages it
    needs unless this interpreter has them all (``target``: where to install them)."""
    tree = upstream_tree()
    given = os.environ.get(PACKAGES_VARIABLE)
    if given:
        return [tree, Path(given)]
    probe = subprocess.run([sys.executable, "-c", f"import {', '.join(PACKAGES)}"],
                           capture_output=True, timeout=120)
    if probe.returncode == 0:
        return [tree]
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                          "--disable-pip-version-check", "--target", str(target), *PACKAGES],
                         capture_output=True, text=True, timeout=300)
    if pip.returncode != 0:
        pytest.skip(f"pip install --target {' '.join(PACKAGES)} failed (set "
                    f"{PACKAGES_VARIABLE} to a folder holding them): {pip.stderr[-300:]}")
    return [tree, target]
