"""Every flag of upstream Megatron-LM core_v0.11.0 parses here, with upstream's destination and
default, and each is implemented, accepted with a note, or refused in one line naming it.

The facts in tests/data/upstream_core_v0_11/ were read off upstream's argument parser
(``megatron/training/arguments.py`` at tag core_v0.11.0, plus the ModelOpt flags of its
``megatron/inference/arguments.py``): each flag's spellings, destination, whether it takes a
value, its nargs and choices. No upstream code is needed to run these tests.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.arguments import ArgumentError, build_parser, parse_args, validate_args
from megatron.training.flags.groups import ARGUMENT_GROUPS
from megatron.training.flags.schema import REFUSED, default_of, spelling, support

FACTS = Path(__file__).resolve().parents[1] / "data" / "upstream_core_v0_11"
REPO = Path(__file__).resolve().parents[2]
UPSTREAM_FLAGS = [json.loads(line) for line in (FACTS / "arguments_flags.jsonl").open()]
# Where this tree's default deliberately differs from upstream's, and why: the layout-free
# format resumes at any parallel layout; upstream's torch_dist is one flag away.
OWN_DEFAULTS = {"ckpt_format": "layout_free"}
SAMPLE_BY_TYPE = {"int": "3", "float": "0.5", "bool": "1"}


def _sample(fact: dict) -> list[str]:
    if not fact["takes_value"]:
        return []
    if fact["choices"]:
        return [str([c for c in fact["choices"] if c is not None][-1])]
    return [SAMPLE_BY_TYPE.get(fact["type"], "x")]


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def test_the_facts_cover_upstream_s_parser():
    assert len(UPSTREAM_FLAGS) == 406 + 6  # arguments.py, then ModelOpt's six
    assert sum(len(fact["flags"]) for fact in UPSTREAM_FLAGS) > 406


@pytest.fixture(scope="module")
def parser():
    return build_parser()


@pytest.mark.parametrize("fact", UPSTREAM_FLAGS, ids=lambda fact: fact["flags"][0])
def test_every_upstream_flag_parses_into_upstream_s_destination(parser, fact):
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    for flag in fact["flags"]:
        assert flag in actions, f"{flag} is not a flag here"
        action = actions[flag]
        dest = "ckpt_fully_parallel_save" if flag == "--ckpt-fully-parallel-save" else fact["dest"]
        assert action.dest == dest
        assert action.nargs == fact["nargs"] or (action.nargs is None and fact["nargs"] is None)
        assert hasattr(parser.parse_args([flag, *_sample(fact)]), dest)


def _fields():
    for _, cls in ARGUMENT_GROUPS:
        yield from dataclasses.fields(cls)


def test_defaults_are_upstream_s():
    defaults = vars(parse_args(argv=[]))
    for fact in UPSTREAM_FLAGS:
        dest = fact["dest"]
        if dest in OWN_DEFAULTS or dest.endswith("_deprecated"):
            continue
        ours, theirs = defaults[dest], ast.literal_eval(fact["default"])
        if dest == "attention_backend":
            ours = ours.name
        if theirs is None and ours is False:
            continue  # upstream leaves some switches None until set; False reads the same
        if dest == "moe_layer_freq":
            ours = int(ours)  # upstream parses "1" or a Python list; refused here either way
        assert ours == theirs, f"{fact['flags'][0]}: {ours!r} here, {theirs!r} upstream"


def test_every_flag_says_how_it_is_supported():
    for field in _fields():
        meta = field.metadata
        assert meta["help"] or meta["accepted"] or meta["refused"], field.name
    assert "[not available here:" in build_parser().format_help()


def _non_default(field) -> list[str]:
    """A command line setting ``field`` to something other than its default."""
    meta, default = field.metadata, default_of(field)
    flag = spelling(field, not default) if isinstance(default, bool) and meta["parse"] is None \
        else None
    if flag is not None:
        return [flag]
    name = spelling(field, "").split()[0]
    if meta["choices"]:
        other = [str(c) for c in meta["choices"] if c != default and not (
            meta["refuse_if"] and not meta["refuse_if"](c))]
        return [name, other[0]]
    if name == "--context-parallel-size":
        return [name, "2"]
    return [name, "7" if not isinstance(default, str) else "elsewhere"]


@pytest.mark.parametrize("field", [f for f in _fields() if support(f.metadata) == REFUSED],
                         ids=lambda field: field.name)
def test_refused_flags_stop_the_run_in_one_line_naming_them(one_rank, field):
    argv = _non_default(field)
    with pytest.raises(ArgumentError) as raised:
        validate_args(parse_args(argv=["--distributed-backend", "gloo", *argv]))
    lines = str(raised.value).splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(argv[0]) and "not available in this tree" in lines[0]


def test_all_refused_flags_are_named_at_once(one_rank):
    argv = ["--distributed-backend", "gloo", "--num-experts", "8", "--use-torch-fsdp2",
            "--tp-comm-overlap", "--fp8-param-gather"]
    with pytest.raises(ArgumentError) as raised:
        validate_args(parse_args(argv=argv))
    named = [line.split(":")[0] for line in str(raised.value).splitlines()]
    assert named == ["--tp-comm-overlap", "--use-torch-fsdp2", "--fp8-param-gather",
                     "--num-experts 8"]


def test_refused_flags_at_their_default_are_harmless(one_rank):
    args = validate_args(parse_args(argv=["--distributed-backend", "gloo", "--num-experts", "0",
                                          "--context-parallel-size", "1", "--moe-router-topk",
                                          "2", "--position-embedding-type", "rope"]))
    assert args.context_parallel_size == 1


def _check(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "check_args.py"), *argv],
                          capture_output=True, text=True, timeout=120)


MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "5", "--lr", "1e-3",
         "--mock-data", "--vocab-size", "128"]


def test_check_args_reports_flag_by_flag_and_its_exit_status_says_whether_the_run_starts():
    good = _check(*MODEL, "--no-persist-layer-norm", "--log-params-norm")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "accepted     --no-persist-layer-norm: apex's persistent" in good.stdout
    assert "implemented  --log-params-norm" in good.stdout
    assert "would start" in good.stdout

    bad = _check("--world-size", "8", *MODEL, "--num-experts", "8", "--made-up-flag")
    assert bad.returncode == 1
    assert "refused      --num-experts: mixture-of-experts" in bad.stdout
    assert "unknown      --made-up-flag" in bad.stdout
    assert "would refuse" in bad.stdout

    inconsistent = _check("--world-size", "3", *MODEL, "--tensor-model-parallel-size", "2")
    assert inconsistent.returncode == 1
    assert "is not divisible by --tensor-model-parallel-size 2" in inconsistent.stdout

    # The paths are the cluster's: no file is opened, not even one of data arguments.
    model = [flag for flag in MODEL if flag != "--mock-data"]
    cluster = _check(*model, "--tokenizer-type", "NullTokenizer", "--data-args-path",
                     "/cluster/only/data_args.txt")
    assert cluster.returncode == 0, cluster.stdout + cluster.stderr


def test_the_flag_table_in_the_docs_is_current():
    generated = subprocess.run([sys.executable, str(REPO / "tools" / "check_args.py"), "--table"],
                               capture_output=True, text=True, timeout=120, check=True).stdout
    assert (REPO / "docs" / "flags.md").read_text() == generated, \
        "docs/flags.md is stale: python tools/check_args.py --table > docs/flags.md"
