"""The thin layer between typed configs and argparse: fields declare flags.

A config group is a dataclass whose fields are made with ``option``; ``add_config_arguments``
turns each field into a flag (field ``seed`` is ``--seed``; ``flags`` gives other spellings,
``negative`` spellings that set a True-by-default field to False) and ``config_from_args``
reads the parsed values back into the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Optional


def option(default: Any, help: str, *, choices: Optional[tuple] = None,
           flags: Optional[tuple[str, ...]] = None, negative: Optional[tuple[str, ...]] = None,
           nargs: Optional[str] = None) -> Any:
    """A dataclass field that is also a command-line flag."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "flags": flags, "negative": negative, "nargs": nargs})


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _base_type(annotation) -> type:
    """``Optional[list[str]]`` -> ``str``: the type of one value on the command line."""
    if typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _add_field(group, field: dataclasses.Field, annotation) -> None:
    meta = field.metadata
    common = {"dest": field.name, "default": field.default}
    base = _base_type(annotation)
    if base is bool:
        positive = meta["flags"] or (() if meta["negative"] else (flag_name(field.name),))
        if positive:
            group.add_argument(*positive, action="store_true", help=meta["help"], **common)
        if meta["negative"]:
            group.add_argument(*meta["negative"], action="store_false",
                               help=f"turn off: {meta['help']}", **common)
        return
    kwargs: dict[str, Any] = {"type": base, "help": meta["help"], **common}
    if meta["choices"]:
        kwargs["choices"] = meta["choices"]
    if meta["nargs"]:
        kwargs["nargs"] = meta["nargs"]
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
