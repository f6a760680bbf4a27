"""``ModuleSpec``: which class builds one part of a layer, with what (megatron-core 0.11's name).

In this tree the GPT layer is described by a TransformerLayerSpec; its ``submodules`` and
``get_mlp_module_spec`` give upstream's view of the same layer, where each part is a
ModuleSpec whose ``submodules`` is what that class takes as its second argument
(``MLP(config, spec.submodules)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ModuleSpec:
    """``module``: the class; ``params``: keyword arguments it is built with;
    ``submodules``: the constructors of its own parts (e.g. an MLPSubmodules), or None."""

    module: Callable
    params: dict = field(default_factory=dict)
    submodules: Any = None
