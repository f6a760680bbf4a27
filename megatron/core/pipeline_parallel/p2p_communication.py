"""Point-to-point communication between pipeline stages.

Upstream Megatron's function API (``recv_forward``, ``send_forward_recv_backward``, ...,
``send_forward_backward_recv_forward_backward``) over one primitive,
``P2PCommunicator.post``, which posts the operations of one call on the pipeline group.

Why this cannot cross or deadlock:

* **One ordering rule.** Every call, batched or not, posts its operations in the order of
  ``ordering.order_ops`` (even pipeline ranks: send-next, recv-prev, send-prev, recv-next; odd
  ranks: recv-prev, send-next, recv-next, send-prev). Activations are sent before gradients
  and received from the previous stage before the next one, on every rank, so at pipeline size
  2, where one channel carries both kinds, both ends agree (upstream #1450).
* **No shape exchange.** With variable sequence lengths an activation's shape travels as a
  small header message right before the payload, in the same group, and the receiver posts the
  payload into a buffer sized for the longest allowed sequence (padded to it over NCCL, which
  needs equal counts). A gradient needs neither: both of its ends know its exact shape (that of
  the activation it belongs to). No blocking round trip before the payload, no second phase
  that the interleaved schedule's wrap-around could wait on (upstream #5100), and no device
  synchronisation to learn shapes: the header of a received activation is read when that
  tensor is waited for, from a side stream on CUDA, so the host waits for that group only.
* **One communicator, waits per stream.** Every group goes through ``batch_isend_irecv`` on
  the pipeline group, so NCCL orders all of it on one communicator; a wait orders the stream
  that consumes the data, and every tensor handed to NCCL stays referenced until then (see
  ``p2p_communicator``).
* **Schedules as data.** The schedules in ``schedules.py`` run plans from ``schedule_plan``,
  in which both ends of every pair of ranks post their operations in the same sequence and
  every blocking call can complete once all ranks reached it; ``simulate`` and ``verify``
  check this for every layout, against models of gloo and of NCCL, without any process group.

Devices: receive buffers live on the current CUDA device when the pipeline group uses NCCL,
on the CPU otherwise; no device-wide synchronisation is ever forced (``batch_p2p_sync`` is
accepted but not needed on the torch versions this tree supports).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel.ordering import PeerOp
from megatron.core.pipeline_parallel.p2p_communicator import (  # noqa: F401  (public names)
    P2PCommunicator, P2PMessage, PendingCall,
)
from megatron.core.utils import timer_span

Shape = Union[list, torch.Size, tuple]


class _Handle:
    """What upstream's overlapped calls return per operation: something with ``wait()``."""

    def __init__(self, call: PendingCall, op: PeerOp):
        self._call, self._op = call, op

    def wait(self) -> None:
        self._call.wait(self._op)


def _default_communicator(config: ModelParallelConfig) -> P2PCommunicator:
    from megatron.core import parallel_state

    return P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)


def _is_first_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_first_stage()


def _is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def _communicate(config: ModelParallelConfig, *, send_next=None, send_prev=None,
                 recv_prev=False, recv_next=False, tensor_shape=None, overlap=False,
                 timer: str):
    if overlap and config.variable_seq_lengths:
        raise ValueError(
            "overlapped p2p calls return their receive buffers before the data lands, which "
            "cannot carry a shape that is only known on arrival: with variable_seq_lengths use "
            "the schedules from get_forward_backward_func(), which overlap without this API")
    # Upstream passes one tensor_shape for everything a call moves: check the sends against it.
    messages = []
    if send_next is not None:
        messages.append(P2PMessage(PeerOp.SEND_NEXT, tensor=send_next, shape=tensor_shape))
    if send_prev is not None:
        messages.append(P2PMessage(PeerOp.SEND_PREV, tensor=send_prev, shape=tensor_shape))
    if recv_prev:
        messages.append(P2PMessage(PeerOp.RECV_PREV, shape=tensor_shape))
    if recv_next:
        messages.append(P2PMessage(PeerOp.RECV_NEXT, shape=tensor_shape))
    if not messages:
        return None, None, {}
    with timer_span(config, timer):
        call = _default_communicator(config).post(messages)
        if overlap:
            # Fixed shapes: the receive buffers are the results once their handle was waited.
            handles = {op.value: _Handle(call, op) for op in call.ops}
            return call.buffer(PeerOp.RECV_PREV), call.buffer(PeerOp.RECV_NEXT), handles
        results = call.wait_all()
    return results.get(PeerOp.RECV_PREV), results.get(PeerOp.RECV_NEXT), None


def recv_forward(tensor_shape: Shape, config: ModelParallelConfig) -> Optional[torch.Tensor]:
    """Receive the activation for this stage from the previous one (None on the first)."""
    if _is_first_stage():
        return None
    return _communicate(config, recv_prev=True, tensor_shape=tensor_shape,
                        timer="forward-recv")[0]


def recv_backward(tensor_shape: Shape, config: ModelParallelConfig) -> Optional[torch.Tensor]:
    """Receive the gradient of this stage's output from the next one (None on the last)."""
    if _is_last_stage():
        return None
    return _communicate(config, recv_next=True, tensor_shape=tensor_shape,
                        timer="backward-recv")[1]


def send_forward(output_tensor: torch.Tensor, config: ModelParallelConfig, *,
                 tensor_shape: Optional[Shape] = None) -> None:
    """Send this stage's output to the next stage (nothing on the last)."""
    if not _is_last_stage():
        _communicate_sends(config, PeerOp.SEND_NEXT, output_tensor, tensor_shape, "forward-send")


def send_backward(input_tensor_grad: torch.Tensor, config: ModelParallelConfig, *,
                  tensor_shape: Optional[Shape] = None) -> None:
    """Send the gradient of this stage's input to the previous stage (nothing on the first)."""
    if not _is_first_stage():
        _communicate_sends(config, PeerOp.SEND_PREV, input_tensor_grad, tensor_shape,
                           "backward-send")


def _communicate_sends(config, op, tensor, tensor_shape, timer):
    with timer_span(config, timer):
        message = P2PMessage(op, tensor=tensor, shape=tensor_shape)
        _default_communicator(config).post([message]).wait_all()


def send_forward_recv_backward(output_tensor: torch.Tensor, tensor_shape: Shape,
                               config: ModelParallelConfig) -> Optional[torch.Tensor]:
    """Send the output forward and receive its gradient, in one call."""
    if _is_last_stage():
        return None
    return _communicate(config, send_next=output_tensor, recv_next=True,
                        tensor_shape=tensor_shape, timer="forward-send-backward-recv")[1]


def send_backward_recv_forward(input_tensor_grad: torch.Tensor, tensor_shape: Shape,
                               config: ModelParallelConfig) -> Optional[torch.Tensor]:
    """Send an input gradient backward and receive the next activation, in one call."""
    if _is_first_stage():
        return None
    return _communicate(config, send_prev=input_tensor_grad, recv_prev=True,
                        tensor_shape=tensor_shape, timer="backward-send-forward-recv")[0]


def send_forward_recv_forward(output_tensor: Optional[torch.Tensor], recv_prev: bool,
                              tensor_shape: Shape, config: ModelParallelConfig,
                              overlap_p2p_comm: bool = False):
    """Send the output forward and receive an activation from the previous stage.

    With ``overlap_p2p_comm`` returns ``(tensor, handles)`` without waiting; the tensor is
    valid once ``handles['recv_prev'].wait()`` returned.
    """
    prev, _, handles = _communicate(
        config, send_next=output_tensor, recv_prev=recv_prev, tensor_shape=tensor_shape,
        overlap=overlap_p2p_comm, timer="forward-send-forward-recv")
    return (prev, handles) if overlap_p2p_comm else prev


def send_backward_recv_backward(input_tensor_grad: Optional[torch.Tensor], recv_next: bool,
                                tensor_shape: Shape, config: ModelParallelConfig,
                                overlap_p2p_comm: bool = False):
    """Send an input gradient backward and receive an output gradient from the next stage."""
    _, nxt, handles = _communicate(
        config, send_prev=input_tensor_grad, recv_next=recv_next, tensor_shape=tensor_shape,
        overlap=overlap_p2p_comm, timer="backward-send-backward-recv")
    return (nxt, handles) if overlap_p2p_comm else nxt


def send_forward_backward_recv_forward_backward(
        output_tensor: Optional[torch.Tensor], input_tensor_grad: Optional[torch.Tensor],
        recv_prev: bool, recv_next: bool, tensor_shape: Shape, config: ModelParallelConfig):
    """Both sends and both receives of a steady-state step, in one call."""
    prev, nxt, _ = _communicate(
        config, send_next=output_tensor, send_prev=input_tensor_grad, recv_prev=recv_prev,
        recv_next=recv_next, tensor_shape=tensor_shape,
        timer="forward-backward-send-forward-backward-recv")
    return prev, nxt
