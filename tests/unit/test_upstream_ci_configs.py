"""Upstream Megatron-LM core_v0.11.0's own GPT CI launch configurations, through this parser.

tests/data/upstream_core_v0_11/gpt_ci_configs.jsonl holds the flag sets of upstream's
``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` (132 files: MODEL_ARGS as the
command line upstream's harness builds from them, and ENV_VARS). Each must either validate as
``pretrain_gpt.py`` would on its GPUs (8, unless the configuration's ``gpus`` says otherwise),
or be refused with lines that each name a flag. Every
configuration that uses none of the features this tree leaves out (mixture of experts, fp8
parameters, FSDP2, ModelOpt) must be accepted: the FP8 ones too (through torchao), and since
2026-12-05 those with context parallelism (and dense models that set an expert tensor-parallel
size) and those of the legacy GPT (``--use-legacy-models``: the megatron-core GPT in its place).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.training.arguments import (
    ArgumentError, parse_args, validate_args, validate_training_args,
)

CONFIGS = [json.loads(line) for line in (Path(__file__).resolve().parents[1] / "data"
                                         / "upstream_core_v0_11" / "gpt_ci_configs.jsonl").open()]
PATHS = {"${DATA_PATH}": "/data", "$DATA_BLEND": "/data/blend", "${DATA_CACHE_PATH}": "/cache",
         "${CHECKPOINT_PATH}": "/ckpt", "${CHECKPOINT_SAVE_PATH}": "/ckpt",
         "${CHECKPOINT_LOAD_PATH}": "/ckpt", "${OUTPUT_PATH}": "/out",
         "${TENSORBOARD_PATH}": "/tb", "${WANDB_EXPERIMENT}": "run",
         "${REPEAT}": "1"}  # the repetition number upstream's harness fills in
OUT_OF_SCOPE = ("--num-experts", "--use-torch-fsdp2",
                "--fp8-param-gather",
                "--export-te-mcore-model", "--export-kd-cfg", "--export-kd-teacher-load")


def argv_of(config: dict) -> list[str]:
    argv = []
    for word in config["argv"]:
        for variable, path in PATHS.items():
            word = word.replace(variable, path)
        argv.append(word)
    return argv


def in_scope(config: dict) -> bool:
    return not any(flag in config["argv"] for flag in OUT_OF_SCOPE)


def validate(config: dict, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(config.get("gpus", 8)))  # upstream's GPUS_PER_NODE
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    for name, value in config["env"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # the configs' 8 GPUs
    args = validate_args(parse_args(argv=argv_of(config)),
                         {"tokenizer_type": "GPT2BPETokenizer"})  # pretrain_gpt.py's default
    validate_training_args(args)


def check_runs_or_is_refused_flag_by_flag(config: dict, monkeypatch, in_scope) -> None:
    """``config`` validates, or, where ``in_scope`` says it uses a feature this tree leaves
    out, is refused in lines that each name a flag."""
    try:
        validate(config, monkeypatch)
    except ArgumentError as error:
        assert not in_scope(config), f"in-scope configuration refused: {error}"
        for line in str(error).splitlines():
            assert line.startswith("--") and "not available in this tree" in line, line


def test_the_facts_hold_all_of_upstream_s_gpt_configurations():
    assert len(CONFIGS) == 132
    assert sum(in_scope(config) for config in CONFIGS) == 108


@pytest.mark.parametrize("config", CONFIGS, ids=lambda config: config["name"])
def test_each_configuration_runs_or_is_refused_flag_by_flag(config, monkeypatch):
    check_runs_or_is_refused_flag_by_flag(config, monkeypatch, in_scope)
