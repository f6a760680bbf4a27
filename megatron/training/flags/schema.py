"""Flags declared as typed dataclass fields, each saying how this tree supports it.

A config group is a dataclass whose fields are made with ``option``; ``add_config_arguments``
turns each field into a flag (field ``seed`` is ``--seed``; ``flags`` gives other spellings,
``negative`` spellings that set a True-by-default field to False) and ``config_from_args``
reads the parsed values back into the dataclass.

Every flag of upstream Megatron-LM parses here, and each field says which of three it is:

* implemented (the default): upstream's meaning;
* ``accepted="..."``: parsed and kept, with what it means here (a knob of one of upstream's own
  kernels, say) -- shown in ``--help`` and by ``tools/check_args.py``;
* ``refused="..."``: a feature this tree does not have. Parsing still succeeds, so the user
  learns about every such flag at once; ``refusals`` then lists those set to anything but their
  default (or matching ``refuse_if``), and validation stops the run before any process group
  exists.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Iterable, Optional

IMPLEMENTED, ACCEPTED, REFUSED = "implemented", "accepted", "refused"


class ArgumentError(ValueError):
    """Arguments that cannot work together, or a feature this tree lacks; names the flags."""


def option(default: Any, help: str, *, choices: Optional[Iterable] = None,
           flags: Optional[tuple[str, ...]] = None, negative: Optional[tuple[str, ...]] = None,
           nargs: Optional[str] = None, parse: Optional[Callable[[str], Any]] = None,
           metavar: Optional[str] = None, accepted: Optional[str] = None, refused: Optional[str] = None,
           refuse_if: Optional[Callable[[Any], bool]] = None) -> Any:
    """A dataclass field that is also a command-line flag.

    ``parse`` converts one command-line value (default: the field's annotated type).
    ``refuse_if`` narrows a refusal to some values (default: any value but the default).
    """
    if accepted is not None and refused is not None:
        raise ValueError("a flag is accepted or refused, not both")
    if refuse_if is not None and refused is None:
        raise ValueError("refuse_if needs refused=<reason>")
    metadata = {
        "help": help, "choices": tuple(choices) if choices is not None else None,
        "flags": flags, "negative": negative, "nargs": nargs, "parse": parse, "metavar": metavar,
        "accepted": accepted, "refused": refused, "refuse_if": refuse_if}
    if isinstance(default, list):  # a dataclass field needs a factory for a mutable default
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def unavailable(default: Any, reason: str, **kwargs) -> Any:
    """A flag of a feature this tree does not have: refused unless left at ``default``."""
    return option(default, "", refused=reason, **kwargs)


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _base_type(annotation) -> type:
    """``Optional[list[str]]`` -> ``str``: the type of one value on the command line."""
    if typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        annotation = typing.get_args(annotation)[0]
    return annotation


def default_of(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def support(meta) -> str:
    return REFUSED if meta["refused"] else ACCEPTED if meta["accepted"] else IMPLEMENTED


def _help(meta) -> str:
    if meta["refused"]:
        text = f"not available here: {meta['refused']}"
        return f"{meta['help']} [{text}]" if meta["help"] else text
    if meta["accepted"]:
        return f"{meta['help']} [accepted: {meta['accepted']}]"
    return meta["help"]


def _add_field(group, field: dataclasses.Field, annotation) -> None:
    meta = field.metadata
    common = {"dest": field.name, "default": default_of(field)}
    base = _base_type(annotation)
    if base is bool and meta["parse"] is None:
        positive = meta["flags"] or (() if meta["negative"] else (flag_name(field.name),))
        if positive:
            group.add_argument(*positive, action="store_true", help=_help(meta), **common)
        if meta["negative"]:
            group.add_argument(*meta["negative"], action="store_false",
                               help=f"turn off: {_help(meta)}", **common)
        return
    kwargs: dict[str, Any] = {"type": meta["parse"] or base, "help": _help(meta), **common}
    if meta["choices"]:
        kwargs["choices"] = meta["choices"]
    if meta["nargs"]:
        kwargs["nargs"] = meta["nargs"]
    if meta["metavar"]:
        kwargs["metavar"] = meta["metavar"]
    group.add_argument(*(meta["flags"] or (flag_name(field.name),)), **kwargs)


def add_config_arguments(parser: argparse.ArgumentParser, title: str, cls: type) -> None:
    """Add one flag per field of the dataclass ``cls``, in an argument group ``title``."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        _add_field(group, field, hints[field.name])


def config_from_args(args: argparse.Namespace, cls: type):
    """The typed config ``cls`` with the values of ``args``."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def spelling(field: dataclasses.Field, value: Any) -> str:
    """How the user wrote ``field`` to get ``value``: ``--no-rope-fusion``, ``--num-experts 8``."""
    meta = field.metadata
    positive = meta["flags"] or (() if meta["negative"] else (flag_name(field.name),))
    if isinstance(value, bool) and meta["parse"] is None:
        return (positive or meta["negative"])[0] if value else (meta["negative"] or positive)[0]
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    return f"{positive[0]} {shown}"


def is_refused(field: dataclasses.Field, value: Any) -> bool:
    meta = field.metadata
    if not meta["refused"]:
        return False
    if meta["refuse_if"] is not None:
        return bool(meta["refuse_if"](value))
    return value != default_of(field)


def refusals(args: argparse.Namespace, groups: Iterable[tuple[str, type]]) -> list[str]:
    """One line per refused flag set in ``args``: the flag as written, and why."""
    lines = []
    for _, cls in groups:
        for field in dataclasses.fields(cls):
            value = getattr(args, field.name, default_of(field))
            if is_refused(field, value):
                lines.append(f"{spelling(field, value)}: not available in this tree: "
                             f"{field.metadata['refused']}")
    return lines


def field_of_each_flag(groups: Iterable[tuple[str, type]]) -> dict[str, dataclasses.Field]:
    """Every spelling (positive and negative) of every flag -> its field."""
    table = {}
    for _, cls in groups:
        for field in dataclasses.fields(cls):
            meta = field.metadata
            positive = meta["flags"] or (() if meta["negative"] else (flag_name(field.name),))
            for name in (*positive, *(meta["negative"] or ())):
                table[name] = field
    return table
