"""Walking nested dicts and lists, the shape of every (sharded) state dict.

Only dicts and lists are containers here; anything else, tuples included, is a leaf.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterator, Tuple, TypeVar, Union

import numpy as np
import torch

U, V = TypeVar("U"), TypeVar("V")
Nested = Union[dict, list]


def extract_matching_values(x: Nested, predicate: Callable[[Any], bool],
                            return_lists_as_dicts: bool = False) -> Tuple[Nested, Nested]:
    """(the leaves ``predicate`` accepts, the rest), both in ``x``'s nesting; a branch with
    nothing on one side is left out of that side (an empty container stays with the rest).
    ``return_lists_as_dicts``: lists come back as ``{index: value}``, so that the original
    positions can be found again."""
    if isinstance(x, dict):
        items, make = x.items(), dict
    elif isinstance(x, list):
        items, make = enumerate(x), (dict if return_lists_as_dicts else list)
    else:
        raise ValueError(f"extract_matching_values expects a dict or a list, got {type(x)}")
    matching, rest = make(), make()

    def put(target, key, value):
        if isinstance(target, dict):
            target[key] = value
        else:
            target.append(value)

    for key, value in items:
        if isinstance(value, (dict, list)) and (value or isinstance(x, dict)):
            sub_matching, sub_rest = extract_matching_values(value, predicate,
                                                             return_lists_as_dicts)
            if sub_matching:
                put(matching, key, sub_matching)
            if sub_rest or not value:
                put(rest, key, sub_rest)
        else:
            put(matching if predicate(value) else rest, key, value)
    return matching, rest


def _leaf_differs(x1: Any, x2: Any) -> bool:
    if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        if x1.shape != x2.shape:
            return True
        return not bool(torch.all(x1.cpu() == x2.cpu()))
    try:
        return bool(x1 != x2)
    except (RuntimeError, ValueError):  # values that cannot say (arrays, tensors vs others)
        return True


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """(paths only in ``x1``, paths only in ``x2``, ``(path, type1, type2)`` of leaves that
    differ), recursively; tensors compare by value, sharded objects by their data."""
    only_left, only_right, mismatch = [], [], []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        pairs = [(k, x1[k], x2[k]) for k in x1.keys() & x2.keys()]
    elif isinstance(x1, (list, tuple, np.ndarray)) and type(x1) is type(x2):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        pairs = [(i, v1, v2) for i, (v1, v2) in enumerate(zip(x1, x2))]
    elif hasattr(x1, "replica_id") and type(x1) is type(x2) and hasattr(x1, "data"):
        return diff(x1.data, x2.data, prefix + (type(x1),))
    else:
        if _leaf_differs(x1, x2):
            mismatch.append((prefix, type(x1), type(x2)))
        return only_left, only_right, mismatch
    for key, v1, v2 in pairs:
        left, right, different = diff(v1, v2, prefix + (key,))
        only_left += left
        only_right += right
        mismatch += different
    return only_left, only_right, mismatch


def inspect_types(x: Any, prefix: Tuple = (), indent: int = 4) -> None:
    """Print the type (a tensor's shape) of every leaf of ``x``, indented by depth."""
    pad = " " * indent * len(prefix)
    if isinstance(x, (dict, list)):
        print()
        for key, value in (x.items() if isinstance(x, dict) else enumerate(x)):
            print(f"{pad}{'>' if isinstance(x, dict) else '-'} {key}: ", end="")
            inspect_types(value, prefix + (key,), indent)
    elif isinstance(x, torch.Tensor):
        print(f"Tensor of shape {x.shape}")
    else:
        try:
            text = str(x)
        except Exception:  # a leaf whose __str__ fails still gets its type printed
            text = "<no string repr>"
        print(f"[{type(x)}]: {text[:30] + '... (truncated)' if len(text) > 30 else text}")


def nested_values(x: Nested) -> Iterator[Any]:
    """Every leaf of ``x``, depth first."""
    for value in (x.values() if isinstance(x, dict) else x):
        if isinstance(value, (dict, list)):
            yield from nested_values(value)
        else:
            yield value


def nested_items_iter(x: Nested) -> Iterator[Tuple[Nested, Any, Any]]:
    """``(container, key, leaf)`` for every leaf of ``x``, depth first."""
    for key, value in (x.items() if isinstance(x, dict) else enumerate(x)):
        if isinstance(value, (dict, list)):
            yield from nested_items_iter(value)
        else:
            yield x, key, value


def dict_map(f: Callable, d: Nested) -> None:
    """Replace every leaf ``v`` of ``d`` with ``f(v)``, in place."""
    for container, key, value in nested_items_iter(d):
        container[key] = f(value)


def dict_map_with_key(f: Callable, d: Nested) -> None:
    """Replace every leaf ``v`` (under ``key`` in its container) with ``f(key, v)``, in place."""
    for container, key, value in nested_items_iter(d):
        container[key] = f(key, value)


def dict_list_map_inplace(f: Callable[[U], V], x: Union[dict, list, U]) -> Union[dict, list, V]:
    """``x`` with every leaf mapped by ``f``; dicts and lists are changed in place."""
    if isinstance(x, dict):
        for key in x:
            x[key] = dict_list_map_inplace(f, x[key])
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, value) for value in x]
        return x
    return f(x)


def dict_list_map_outplace(f: Callable[[U], V], x: Union[dict, list, U]) -> Union[dict, list, V]:
    """A new nesting like ``x`` holding ``f`` of each leaf; ``x`` is left alone."""
    if isinstance(x, dict):
        return {key: dict_list_map_outplace(f, value) for key, value in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, value) for value in x]
    return f(x)


def merge(x1: Nested, x2: Nested, key: Tuple[Union[str, int], ...] = ()) -> Nested:
    """Merge ``x2`` into ``x1`` (in place, returned): dicts key by key, lists of equal length
    item by item; two leaves at one place are an error."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(f"cannot merge lists of different lengths ({len(x1)} and "
                             f"{len(x2)}) at {key}")
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
    else:
        raise ValueError(f"cannot merge two values at {key}: {x1!r} and {x2!r} (only dicts and "
                         f"lists merge)")
    return x1


def map_reduce(xs, key_fn: Callable = lambda x: x, value_fn: Callable = lambda x: x,
               reduce_fn: Callable = lambda x: x) -> dict:
    """``{key_fn(x): reduce_fn([value_fn(x) for x with that key])}``, keys in first-seen order
    (``more_itertools.map_reduce``)."""
    grouped = defaultdict(list)
    for x in xs:
        grouped[key_fn(x)].append(value_fn(x))
    return {key: reduce_fn(values) for key, values in grouped.items()}
