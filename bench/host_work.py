"""Host work of pretrain_gpt.py's step against the bare model's, phase by phase, counted.

    python bench/host_work.py [--num-layers 24] [--trainer-args "..."]

Where a step is close to host-bound (the 1.3B shape on an H200), every Python call and every
operator the trainer adds to the model's own forward, backward and Adam is time the GPU may
wait, most of all right after the step's device synchronizations (the NaN checks, the gradient
norm), when the queue is empty. Timing that on a shared CPU is noise; counting it is not. This
bench runs the trainer's step (``megatron.training.train``, one micro-batch per step, the
flags of ``bench/gpt_step.py``'s trainer rows) and the model-only step (the same GPT, torch's
AdamW) on the CPU over gloo, at full depth and a tiny width (compute is negligible, the host
work per step does not depend on the width), and counts per phase the Python calls (functions
and builtins, as ``sys.setprofile`` sees them), the ATen operators dispatched and the host reads
of a tensor's value (device synchronizations on a GPU). Torch's AdamW
runs its fused kernel in both, as the trainer's does on a GPU. It prints the table and the
trainer's totals as multiples of the model's; run to run the counts differ by a few calls.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

PHASES = ("loop", "forward", "backward", "finalize", "optimizer")


def parse_args(argv=None) -> argparse.Namespace:
    import gpt_step

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpt_step.add_shape_arguments(parser)
    parser.set_defaults(hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
    parser.add_argument("--steps", type=int, default=5, help="steps counted (after two)")
    parser.add_argument("--trainer-args", default="",
                        help="more pretrain_gpt.py flags for the trainer, e.g. "
                        "'--trainer-args=--use-precision-aware-optimizer' (on a CPU its "
                        "torch fallback runs, not the GPU's kernel)")
    parser.add_argument("--quick", action="store_true", help="count one step")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 1
    return args


class _Tally:
    """Python calls, ATen operators and host reads of a tensor's value (``.item()``, ``float()``:
    on a GPU each waits for the device to drain its queue), each counted against the innermost
    open phase."""

    def __init__(self):
        self.phase = ["loop"]
        self.calls: Counter = Counter()
        self.ops: Counter = Counter()
        self.reads: Counter = Counter()

    def tagged(self, fn, phase: str):
        def inner(*args, **kwargs):
            self.phase.append(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase.pop()
        return inner

    @contextlib.contextmanager
    def counting(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        tally = self

        class Operators(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                tally.ops[tally.phase[-1]] += 1
                if func is torch.ops.aten._local_scalar_dense.default:
                    tally.reads[tally.phase[-1]] += 1
                return func(*args, **(kwargs or {}))

        def profile(frame, event, arg):
            if event in ("call", "c_call"):
                tally.calls[tally.phase[-1]] += 1

        self.calls.clear()
        self.ops.clear()
        self.reads.clear()
        with Operators():
            sys.setprofile(profile)
            try:
                yield
            finally:
                sys.setprofile(None)


def fused_adam_everywhere() -> None:
    """The trainer's torch AdamW fused on a CPU too (it is on a GPU), as the model's is."""
    from megatron.core.optimizer import fused_kernels

    fused_kernels._all_on_gpu = lambda param_groups: True


def trainer_counts(args, tally: _Tally) -> tuple[Counter, Counter, Counter]:
    import torch

    import gpt_step
    import pretrain_gpt
    from megatron.core.pipeline_parallel import plan_executor
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training import get_args, training

    shape_args = argparse.Namespace(**vars(args), micro_batch_size=1, microbatches=1,
                                    warmup=2)
    model, optimizer, scheduler, config = gpt_step.start_trainer(
        shape_args, [], port=os.environ.get("MASTER_PORT"))
    batch = gpt_step.full_length_batch(shape_args, torch.Generator().manual_seed(1))

    def batches():
        while True:
            yield batch

    def train(first: int, last: int) -> None:
        get_args().train_iters = last
        with contextlib.redirect_stdout(io.StringIO()):
            training.train(pretrain_gpt.forward_step, model, optimizer, scheduler,
                           RerunDataIterator(batches()),
                           None, None, config, first, 0)

    train(0, 2)
    plan_executor.forward_step = tally.tagged(plan_executor.forward_step, "forward")
    plan_executor.backward_step = tally.tagged(plan_executor.backward_step, "backward")
    config.finalize_model_grads_func = tally.tagged(config.finalize_model_grads_func,
                                                    "finalize")
    optimizer.step = tally.tagged(optimizer.step, "optimizer")
    with tally.counting():
        train(2, 2 + args.steps)
    return Counter(tally.calls), Counter(tally.ops), Counter(tally.reads)


def model_counts(args, tally: _Tally) -> tuple[Counter, Counter, Counter]:
    """The same GPT with bf16 parameters and torch's fused AdamW over them, nothing else."""
    import torch

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=4 * args.hidden_size,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    model = Float16Module(config, GPTModel(config, get_gpt_layer_local_spec(),
                                           vocab_size=args.vocab_size,
                                           max_sequence_length=args.seq_length))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    shape = (1, args.seq_length)
    tokens = torch.randint(0, args.vocab_size, shape)
    positions = torch.arange(args.seq_length).expand(shape)

    def step():
        tally.phase.append("optimizer")
        optimizer.zero_grad(set_to_none=True)
        tally.phase[-1] = "forward"
        loss = model(tokens, positions, None, labels=tokens).mean()
        tally.phase[-1] = "backward"
        loss.backward()
        tally.phase[-1] = "optimizer"
        optimizer.step()
        tally.phase.pop()

    for _ in range(2):
        step()
    with tally.counting():
        for _ in range(args.steps):
            step()
    return Counter(tally.calls), Counter(tally.ops), Counter(tally.reads)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # counted on the CPU, also on a GPU machine
    import torch

    torch.manual_seed(0)
    fused_adam_everywhere()
    trainer_calls, trainer_ops, trainer_reads = trainer_counts(args, _Tally())
    model_calls, model_ops, model_reads = model_counts(args, _Tally())
    steps = args.steps
    print(f"Host work per step: {args.num_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads, sequence {args.seq_length}; one micro-batch; "
          f"torch {torch.__version__}; command: python bench/host_work.py "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}")
    counters = (trainer_calls, model_calls, trainer_ops, model_ops, trainer_reads, model_reads)
    print(f"{'phase':10s} {'trainer calls':>14s} {'model calls':>12s} {'trainer ops':>12s} "
          f"{'model ops':>10s} {'trainer reads':>14s} {'model reads':>12s}")
    widths = (14, 12, 12, 10, 14, 12)
    for phase in PHASES:
        print(f"{phase:10s} " + " ".join(f"{c[phase] / steps:{w}.0f}"
                                         for c, w in zip(counters, widths)))
    totals = [sum(counter.values()) / steps for counter in counters]
    print(f"{'total':10s} " + " ".join(f"{t:{w}.0f}" for t, w in zip(totals, widths)))
    print(f"trainer/model host work: Python calls {totals[0] / totals[1]:.3f}x, ATen operators "
          f"{totals[2] / totals[3]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
