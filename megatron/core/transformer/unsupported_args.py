"""Refusing upstream arguments that this tree accepts in signatures but does not implement."""

from __future__ import annotations


def reject_given(**arguments) -> None:
    """Raise ValueError naming every argument that is not None."""
    given = [name for name, value in arguments.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: not supported by this tree; pass None")
