"""pytest plugin the runner loads in both runs when Transformer Engine cannot be imported.

Upstream's tests/unit_tests/conftest.py asks ``is_te_min_version("1.3")`` in a fixture that
every test uses; upstream's answer without Transformer Engine is an ImportError, which would
make every test an error in upstream's run and leave nothing to compare. Here the conftest's
own reference to that function answers False instead, which is what "no TE" means to it (the
fixture then leaves the NVTE_* variables alone). Nothing else changes: tests and library code
that need Transformer Engine still fail or skip as they would, in both runs alike.
"""

import importlib.util

import pytest


def _te_absent(*_args, **_kwargs) -> bool:
    return False


def _is_upstream_conftest(plugin) -> bool:
    path = str(getattr(plugin, "__file__", "") or "").replace("\\", "/")
    return path.endswith("tests/unit_tests/conftest.py")


@pytest.hookimpl
def pytest_plugin_registered(plugin, manager):
    if _is_upstream_conftest(plugin) and hasattr(plugin, "is_te_min_version"):
        plugin.is_te_min_version = _te_absent


def pytest_report_header(config):
    if importlib.util.find_spec("transformer_engine") is None:
        return "transformer_engine absent: the conftest's TE version check answers False"
    return None
