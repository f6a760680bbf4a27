"""Check a Megatron-LM launch command against this tree before a cluster job runs it.

    python tools/check_args.py [--world-size N] <the flags given to pretrain_gpt.py>

Prints, flag by flag, whether this tree implements it with upstream's meaning, accepts it with
a note (a knob of one of upstream's own kernels, say), or refuses it and why; flags neither
upstream Megatron-LM core_v0.11.0 nor this tree knows are listed too. Then validates the whole
set as ``pretrain_gpt.py`` would on a job of ``--world-size`` ranks (default $WORLD_SIZE, else
tensor x pipeline x context parallel sizes) and prints the outcome. The GPUs the job will have
are assumed present. Exit status 0 when the run would start, 1 when it would be refused.

Paste the flags straight from a launch script; shell variables must be expanded (any path will
do: no file is opened).

    python tools/check_args.py --table > docs/flags.md

writes the whole table of flags (every group, every spelling, how it is supported) as Markdown.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training.arguments import (  # noqa: E402
    ArgumentError, build_parser, validate_args, validate_training_args,
)
from megatron.training.flags.groups import ARGUMENT_GROUPS  # noqa: E402
from megatron.training.flags.schema import (  # noqa: E402
    ACCEPTED, IMPLEMENTED, REFUSED, field_of_each_flag, flag_name, is_refused, support,
)

# pretrain_gpt.py's defaults for flags left unset, as upstream's.
PRETRAIN_GPT_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


def _take_world_size(argv: list[str]) -> tuple[int | None, list[str]]:
    if "--world-size" not in argv:
        return None, argv
    at = argv.index("--world-size")
    if at + 1 >= len(argv) or not argv[at + 1].isdigit():
        raise SystemExit("check_args: --world-size takes a number of ranks")
    return int(argv[at + 1]), argv[:at] + argv[at + 2:]


def flag_report(argv: list[str]) -> tuple[list[str], bool]:
    """One line per flag given, and whether any of them is refused or unknown."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    fields = field_of_each_flag(ARGUMENT_GROUPS)
    lines, blocked, seen = [], False, set()
    for token in argv:
        flag = token.split("=", 1)[0]
        if not flag.startswith("--") or flag in seen:
            continue
        seen.add(flag)
        if flag in unknown or token in unknown:
            lines.append(f"  unknown      {flag}: not a flag of Megatron-LM core 0.11 or of this tree "
                         f"(later Megatron-LM's are not implemented but for those "
                         f"docs/flags.md lists)")
            blocked = True
            continue
        field = fields.get(flag)
        if field is None:
            continue  # a value that looks like a flag, or --help
        kind = support(field.metadata)
        if kind == REFUSED and is_refused(field, getattr(args, field.name)):
            lines.append(f"  refused      {flag}: {field.metadata['refused']}")
            blocked = True
        elif kind == ACCEPTED:
            lines.append(f"  accepted     {flag}: {field.metadata['accepted']}")
        else:
            lines.append(f"  implemented  {flag}")
    return lines, blocked


def validation_outcome(argv: list[str], world_size: int | None) -> str | None:
    """None when ``pretrain_gpt.py`` would start with these flags, else why not."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        return f"unknown arguments: {' '.join(unknown)}"
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "0")) or (
            args.tensor_model_parallel_size * args.pipeline_model_parallel_size
            * args.context_parallel_size)
    environment = {"WORLD_SIZE": str(world_size), "RANK": "0"}
    try:
        with mock.patch.dict(os.environ, environment), \
                mock.patch("torch.cuda.is_available", return_value=True):
            validate_training_args(validate_args(args, dict(PRETRAIN_GPT_DEFAULTS)),
                                   read_files=False)
    except ArgumentError as error:
        return str(error)
    return None


def _spellings(field) -> str:
    meta = field.metadata
    names = meta["flags"] or (() if meta["negative"] else (flag_name(field.name),))
    return ", ".join(f"`{name}`" for name in (*names, *(meta["negative"] or ())))


def flag_table() -> str:
    """Every flag as Markdown: by group, its spellings, how it is supported, what it does."""
    counts = {IMPLEMENTED: 0, ACCEPTED: 0, REFUSED: 0}
    sections = []
    for title, cls in ARGUMENT_GROUPS:
        rows = ["| flag | here | meaning |", "|---|---|---|"]
        for field in dataclasses.fields(cls):
            meta, kind = field.metadata, support(field.metadata)
            note = {IMPLEMENTED: meta["help"], ACCEPTED: f"{meta['help']} {meta['accepted']}",
                    REFUSED: meta["refused"]}[kind].strip()
            label = kind
            if kind == REFUSED and meta["refuse_if"] is not None and meta["help"]:
                kind, label = IMPLEMENTED, "implemented, some values refused"
                note = f"{meta['help']}; refused: {meta['refused']}"
            counts[kind] += 1
            rows.append(f"| {_spellings(field)} | {label} | {note.replace('|', '/')} |")
        sections.append(f"## {title}\n\n" + "\n".join(rows))
    summary = (f"{sum(counts.values())} flags: {counts[IMPLEMENTED]} implemented with upstream's "
               f"meaning, {counts[ACCEPTED]} accepted with a note on what they mean here, "
               f"{counts[REFUSED]} refused (a refused flag left at its default is harmless).")
    return ("# Every flag\n\nGenerated by `python tools/check_args.py --table`; "
            "`tests/unit/test_upstream_flags.py` checks it is current.\n\n" + summary + "\n\n"
            + "\n\n".join(sections) + "\n")


def main(argv: list[str]) -> int:
    world_size, argv = _take_world_size(argv)
    if not argv or argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv == ["--table"]:
        print(flag_table(), end="")
        return 0
    lines, blocked = flag_report(argv)
    print("flags:")
    print("\n".join(lines))
    problem = validation_outcome(argv, world_size)
    if problem is None and not blocked:
        print("outcome: pretrain_gpt.py would start with these flags")
        return 0
    print("outcome: pretrain_gpt.py would refuse this run:")
    print("\n".join(f"  {line}" for line in (problem or "see the flags above").splitlines()))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
