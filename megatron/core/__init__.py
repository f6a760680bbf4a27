"""Core building blocks, importable under megatron-core 0.11 names.

Only the config is exported here; submodules such as ``parallel_state`` or
``pipeline_parallel`` load on first import (``from megatron.core import parallel_state``)
so that importing the package stays cheap and free of distributed side effects.
"""

from megatron.core.model_parallel_config import ModelParallelConfig

__version__ = "0.1.0"

__all__ = ["ModelParallelConfig", "__version__"]
