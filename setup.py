"""Packaging for megatron-safepipe (the import package is ``megatron``)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

_ROOT = Path(__file__).resolve().parent


def _read_version() -> str:
    # megatron/core/__init__.py is the single source of the version; parse it rather than
    # importing it so that building does not need torch.
    text = (_ROOT / "megatron" / "core" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError("setup.py: no `__version__ = \"...\"` line in megatron/core/__init__.py")
    return match.group(1)


setup(
    name="megatron-safepipe",
    version=_read_version(),
    description="Megatron-LM compatible GPT pretraining with pipeline parallelism",
    license="Apache-2.0",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "numpy", "sentencepiece", "tokenizers>=0.19"],
    # --fp8-format without Transformer Engine.
    extras_require={"fp8": ["torchao>=0.18"]},
)
