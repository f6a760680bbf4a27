"""The forward and backward of one microbatch through one model chunk.

Upstream-compatible helpers (``forward_step``, ``backward_step``, ``deallocate_output_tensor``,
``custom_backward``, ``check_first_val_step``, ``set_current_microbatch``); the schedules call
them and so may user code written for megatron.core 0.11.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from megatron.core.utils import get_attr_wrapped_model, timer_span


def _last_stage_from_state() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def deallocate_output_tensor(out: Optional[torch.Tensor], deallocate_pipeline_outputs: bool = False):
    """Drop the storage of an output that was already sent; its autograd graph stays.

    Only worth doing (and only done) for a tensor that owns its storage: freeing a view
    would release nothing.
    """
    if out is None or not deallocate_pipeline_outputs or out._base is not None:
        return
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: Optional[torch.Tensor]) -> None:
    """Backward from ``output`` even when its data was deallocated.

    ``torch.autograd.backward`` insists that the gradient has the output's current shape,
    which a deallocated output no longer has; the autograd engine itself only needs the
    graph, so it is called directly.
    """
    if grad_output is None:
        if output.numel() != 1:
            raise RuntimeError("backward without a gradient needs a scalar output (the loss)")
        grad_output = torch.ones_like(output)
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad_output,), False, False, (), True, True)


def check_first_val_step(first_val_step: Optional[bool], forward_only: bool, cond: bool) -> bool:
    """Whether this is the first microbatch of the first validation step (for fp8 caches)."""
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def set_current_microbatch(model: torch.nn.Module, microbatch_id: int) -> None:
    """Tell a model with a ``decoder`` which microbatch runs (used by some layers)."""
    try:
        decoder = get_attr_wrapped_model(model, "decoder")
    except RuntimeError:
        return
    if decoder is not None:
        decoder.current_microbatch = microbatch_id


def _autocast(config) -> contextlib.AbstractContextManager:
    if not getattr(config, "enable_autocast", False):
        return contextlib.nullcontext()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.autocast(device_type, dtype=config.autocast_dtype)


def forward_step(
    forward_step_func: Callable,
    data_iterator: Any,
    model: torch.nn.Module,
    num_microbatches: int,
    input_tensor: Any,
    forward_data_store: list,
    config,
    collect_non_loss_data: bool = False,
    checkpoint_activations_microbatch: Optional[bool] = None,
    is_first_microbatch: bool = False,
    current_microbatch: Optional[int] = None,
    encoder_decoder_xattn: bool = False,
    *,
    is_last_stage: Optional[bool] = None,
):
    """Run ``forward_step_func`` on one microbatch; on the last stage, also its loss function.

    Returns ``(output, num_tokens)``. On the last stage the output is the loss, divided by
    ``num_microbatches`` (and by the token count when the loss function returns one and
    ``calculate_per_token_loss`` is off), so that gradients accumulate to the batch mean; the
    loss function's report goes to ``forward_data_store``. ``is_last_stage`` defaults to what
    parallel_state says.
    """
    if encoder_decoder_xattn:
        raise ValueError("encoder-decoder models are not supported by this tree")
    if is_last_stage is None:
        is_last_stage = _last_stage_from_state()
    with timer_span(config, "forward-compute"):
        if is_first_microbatch and hasattr(model, "set_is_first_microbatch"):
            model.set_is_first_microbatch()
        if current_microbatch is not None:
            set_current_microbatch(model, current_microbatch)
        inputs = input_tensor if isinstance(input_tensor, list) else [input_tensor]
        get_attr_wrapped_model(model, "set_input_tensor")(inputs)

        with _autocast(config):
            if checkpoint_activations_microbatch is None:
                output_tensor, loss_func = forward_step_func(data_iterator, model)
            else:
                output_tensor, loss_func = forward_step_func(
                    data_iterator, model, checkpoint_activations_microbatch)

        num_tokens = torch.tensor(0, dtype=torch.int)
        if is_last_stage:
            if collect_non_loss_data:
                forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
            else:
                outputs = loss_func(output_tensor)
                if len(outputs) == 3:
                    output_tensor, num_tokens, reported = outputs
                    if not getattr(config, "calculate_per_token_loss", False):
                        output_tensor = output_tensor / num_tokens / num_microbatches
                elif len(outputs) == 2:
                    output_tensor, reported = outputs
                    output_tensor = output_tensor / num_microbatches
                else:
                    raise ValueError(
                        "the loss function must return (loss, report) or "
                        f"(loss, num_tokens, report); it returned {len(outputs)} values")
                forward_data_store.append(reported)
    return output_tensor, num_tokens


def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
    """Backward of one microbatch through one chunk; returns the gradient of its input.

    ``output_tensor_grad`` is None on the last stage, where ``output_tensor`` is the loss and
    ``config.grad_scale_func`` (loss scaling) applies.
    """
    del model_type  # encoder-decoder skip connections are not supported
    with timer_span(config, "backward-compute"):
        if input_tensor is not None:
            input_tensor.retain_grad()
        if output_tensor_grad is None and config.grad_scale_func is not None:
            output_tensor = config.grad_scale_func(output_tensor)
        if config.deallocate_pipeline_outputs:
            custom_backward(output_tensor, output_tensor_grad)
        else:
            torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
        return None if input_tensor is None else input_tensor.grad
