"""Later upstream's GPT training launch configurations, through this parser.

tests/data/upstream_main/gpt_ci_configs.jsonl holds the flag sets of the 167 training
configurations among ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of upstream
Megatron-LM's main branch at d98e8a64 (2026-08-22, megatron-core 0.20 in development): MODEL_ARGS
as upstream's harness turns them into a command line (``true``: the bare flag; a bracketed
list, or the value of a flag taking several: one argument per word), ENV_VARS, and ``gpus``
where MODEL_ENV_VARS gives another GPUS_PER_NODE than 8. This tree implements core 0.11's flags
and a few of later upstream's; a configuration that uses only flags parsed here must validate as
``pretrain_gpt.py`` would on its GPUs, or be refused with lines that each name a flag of a
feature this tree leaves out (those of core 0.11's configurations, multi-latent attention and
Transformer Engine's communication overlap). The rest use later flags this tree does not parse,
counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.training.arguments import build_parser
from tests.unit import test_upstream_ci_configs as core_0_11

CONFIGS = [json.loads(line) for line in (Path(__file__).resolve().parents[1] / "data"
                                         / "upstream_main" / "gpt_ci_configs.jsonl").open()]
KNOWN = {flag for action in build_parser()._actions for flag in action.option_strings}
LATER_OUT_OF_SCOPE = ("--multi-latent-attention", "--tp-comm-overlap")


def in_scope(config: dict) -> bool:
    return core_0_11.in_scope(config) and not any(flag in config["argv"]
                                                  for flag in LATER_OUT_OF_SCOPE)


def unknown_flags(config: dict) -> set[str]:
    return {word for word in config["argv"] if word.startswith("--") and word not in KNOWN}


PARSED = [config for config in CONFIGS if not unknown_flags(config)]


def test_the_facts_hold_upstream_main_s_gpt_training_configurations():
    assert len(CONFIGS) == 167
    assert len(PARSED) == 150
    assert sum(in_scope(config) for config in PARSED) == 140
    # The other 17 set some of 51 later flags of features: reinforcement learning, gated
    # delta-net and sparse attention variants, megatron FSDP, muP, fill-in-the-middle data.
    needing_later = [config for config in CONFIGS if unknown_flags(config)]
    assert len(needing_later) == 17
    assert len(set().union(*map(unknown_flags, needing_later))) == 51


@pytest.mark.parametrize("config", PARSED, ids=lambda config: config["name"])
def test_each_parsed_configuration_runs_or_is_refused_flag_by_flag(config, monkeypatch):
    core_0_11.check_runs_or_is_refused_flag_by_flag(config, monkeypatch, in_scope)
