"""What one pipeline step puts on the wire and waits for, counted on one rank, on either tree.

Both trees post every pipeline p2p operation of a batched step through
``torch.distributed.batch_isend_irecv``: this tree every group that ``P2PCommunicator.post``
builds, upstream 0.11.0 its batched payloads and its shape exchange. ``WireProbe.install``
wraps that function once in the rank's process; while a step is timed (``start`` to ``stop``)
the wrapper counts the sends handed to it, before they are posted:

* ``payload_bytes``: bytes of the tensors of the pipeline dtype (activations and gradients, as
  sent: this tree's NCCL activations padded to the longest allowed sequence);
* ``meta_bytes``: bytes of the int64 tensors (this tree's 128-byte shape headers, upstream's
  24-byte shape messages);
* ``sends``: send operations, and ``groups``: calls of ``batch_isend_irecv``.

Every byte travels once, from the send that carries it, so the sums over the ranks are the
bytes on the wire (NCCL's own protocol framing aside). The probe also counts ``host_waits``,
the explicit waits of the host for the device during the step (``torch.cuda.synchronize`` and
``torch.cuda.Event.synchronize``; under upstream's CPU shims the former are no-ops, counted
all the same), and ``compute_s``, what the synthetic stages actually spent
(``synthetic.take_compute_s``). Like ``synthetic``, it imports no ``megatron``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import synthetic

_installed: Optional["WireProbe"] = None


class WireProbe:
    """The ``stepping.StepProbe`` of ``bench/nccl_p2p.py`` (one per process: ``install``)."""

    @classmethod
    def install(cls) -> "WireProbe":
        global _installed
        if _installed is None:
            _installed = cls()
        return _installed

    def __init__(self):
        self._counting = False
        self._counts = dict.fromkeys(("payload_bytes", "meta_bytes", "sends", "groups",
                                      "host_waits"), 0)
        post = dist.batch_isend_irecv

        def counted_post(p2p_op_list):
            if self._counting:
                self._count(p2p_op_list)
            return post(p2p_op_list)

        dist.batch_isend_irecv = counted_post
        self._wrap_waits()

    def _wrap_waits(self) -> None:
        synchronize = torch.cuda.synchronize
        event_synchronize = torch.cuda.Event.synchronize

        def counted_synchronize(*args, **kwargs):
            if self._counting:
                self._counts["host_waits"] += 1
            return synchronize(*args, **kwargs)

        def counted_event_synchronize(event):
            if self._counting:
                self._counts["host_waits"] += 1
            return event_synchronize(event)

        torch.cuda.synchronize = counted_synchronize
        torch.cuda.Event.synchronize = counted_event_synchronize

    def _count(self, p2p_op_list) -> None:
        self._counts["groups"] += 1
        for p2p in p2p_op_list:
            if getattr(p2p.op, "__name__", "") != "isend":
                continue
            tensor = p2p.tensor
            kind = "meta_bytes" if tensor.dtype == torch.int64 else "payload_bytes"
            self._counts[kind] += tensor.numel() * tensor.element_size()
            self._counts["sends"] += 1

    def start(self) -> None:
        for key in self._counts:
            self._counts[key] = 0
        synthetic.take_compute_s()  # drop what untimed work recorded
        synthetic.time_compute(True)
        self._counting = True

    def stop(self) -> None:
        self._counting = False
        synthetic.time_compute(False)

    def figures(self) -> dict[str, float]:
        return {**{key: float(value) for key, value in self._counts.items()},
                "compute_s": synthetic.take_compute_s()}
