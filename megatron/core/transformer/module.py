"""MegatronModule (a torch module that carries its config) and the fp16/bf16 model wrapper."""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.sharded_state import module_sharded_state_dict


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for the last pipeline stage's copy of tied embeddings (counted once elsewhere)."""
    return not getattr(param, "shared", False)


class MegatronModule(torch.nn.Module):
    """A torch module with a ``config``; base of every model and layer in this package."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The state dict written to checkpoints (the plain one unless a subclass overrides)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """This module's tensors as megatron-core's sharded state dict, for
        ``megatron.core.dist_checkpointing.save`` / ``load`` (``sharded_state``)."""
        return module_sharded_state_dict(self, prefix, sharded_offsets, metadata)


def _convert_floats(value: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors, also inside tuples/lists, to ``dtype``; leave the rest."""
    if isinstance(value, (tuple, list)):
        return type(value)(_convert_floats(item, dtype) for item in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


class Float16Module(MegatronModule):
    """Runs ``module`` with fp16 or bf16 parameters; float inputs of the first stage are cast
    down and float outputs of the last stage are cast back to fp32.

    Whether the wrapped chunk is first/last is read from its ``pre_process``/``post_process``
    when it has them (GPTModel does), else from parallel_state as upstream does.
    """

    def __init__(self, config, module: torch.nn.Module) -> None:
        super().__init__(config)
        if config.fp16:
            self.half_dtype = torch.float16
        elif config.bf16:
            self.half_dtype = torch.bfloat16
        else:
            raise ValueError("Float16Module needs config.fp16=True or config.bf16=True")
        self.fp16, self.bf16 = config.fp16, config.bf16
        self.add_module("module", module.to(self.half_dtype))

    def _is_first_chunk(self) -> bool:
        if hasattr(self.module, "pre_process"):
            return bool(self.module.pre_process)
        return parallel_state.is_pipeline_first_stage()

    def _is_last_chunk(self) -> bool:
        if hasattr(self.module, "post_process"):
            return bool(self.module.post_process)
        return parallel_state.is_pipeline_last_stage()

    def set_input_tensor(self, input_tensor) -> None:
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, **kwargs):
        if self._is_first_chunk():
            inputs = _convert_floats(inputs, self.half_dtype)
        outputs = self.module(*inputs, **kwargs)
        if self._is_last_chunk():
            outputs = _convert_floats(outputs, torch.float32)
        return outputs

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
