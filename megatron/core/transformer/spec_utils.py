"""``ModuleSpec``: which class builds one part of a layer, with what (megatron-core 0.11's name).

In this tree the GPT layer is described by a TransformerLayerSpec; its ``submodules`` and
``get_mlp_module_spec`` give upstream's view of the same layer, where each part is a
ModuleSpec whose ``submodules`` is what that class takes as its second argument
(``MLP(config, spec.submodules)``).
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ModuleSpec:
    """``module``: the class; ``params``: keyword arguments it is built with;
    ``submodules``: the constructors of its own parts (e.g. an MLPSubmodules), or None."""

    module: Callable
    params: dict = field(default_factory=dict)
    submodules: Any = None


def import_module(module_path: tuple[str, str]) -> Any:
    """The object ``name`` of the module ``path``, for ``module_path = (path, name)``."""
    path, name = module_path
    try:
        return getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(f"cannot import {name} from {path} (a ModuleSpec's module): "
                          f"{error}") from error


def build_module(spec_or_module: Any, *args, **kwargs) -> Any:
    """What a spec describes, built: ``module(*args, **spec.params, **kwargs)`` with the
    spec's ``submodules`` passed as ``submodules=`` when it has some. A function (given, or as
    the spec's module) is returned as it is, not called; ``module`` may also be an
    ``(import path, name)`` pair."""
    if isinstance(spec_or_module, types.FunctionType):
        return spec_or_module
    module = getattr(spec_or_module, "module", spec_or_module)
    if isinstance(module, tuple):
        module = import_module(module)
    if isinstance(module, types.FunctionType):
        return module
    params = dict(getattr(spec_or_module, "params", None) or {})
    submodules = getattr(spec_or_module, "submodules", None)
    if submodules is not None:
        kwargs["submodules"] = submodules
    try:
        return module(*args, **params, **kwargs)
    except TypeError as error:
        name = getattr(module, "__name__", repr(module))
        raise TypeError(f"building {name} from its spec: {error}") from error
