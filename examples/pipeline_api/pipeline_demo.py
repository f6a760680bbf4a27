"""megatron.core's pipeline API on its own: train a small model, interleaved, on CPU/gloo.

This is the combination upstream Megatron-LM breaks (pipeline size 2, two virtual stages per
rank, variable sequence lengths, batched p2p): a hang or a crash with variable lengths,
silently wrong gradients with equal ones. Launch it like any Megatron job:

    torchrun --nproc_per_node 2 examples/pipeline_api/pipeline_demo.py

Each step runs one global batch of microbatches of different lengths through the
interleaved 1F1B schedule, then Adam. At the end the pipelined loss curve is compared with
the same training in one process, step by step.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import time

import torch
import torch.distributed as dist

from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="model chunks per pipeline rank (interleaving)")
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=32, help="longest sequence")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--num-microbatches", type=int, default=8)
    parser.add_argument("--train-iters", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--equal-lengths", action="store_true",
                        help="every microbatch has --seq-length tokens")
    parser.add_argument("--p2p", choices=("batched", "unbatched", "overlapped"),
                        default="batched")
    return parser.parse_args()


class Block(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def build_stage(stage: int, args) -> torch.nn.Sequential:
    torch.manual_seed(100 + stage)  # any process can build any stage identically
    return torch.nn.Sequential(*[Block(args.hidden_size) for _ in range(args.layers_per_stage)])


class Chunk(torch.nn.Module):
    """One virtual pipeline stage, with the chunk protocol megatron schedules expect."""

    def __init__(self, stage: int, num_stages: int, config, args):
        super().__init__()
        self.config, self.model_type = config, ModelType.encoder_or_decoder
        self.pre_process, self.post_process = stage == 0, stage == num_stages - 1
        self.layers = build_stage(stage, args)
        self.input_tensor = None

    def set_input_tensor(self, input_tensor):
        self.input_tensor = input_tensor[0]

    def forward(self, x):
        return self.layers(x if self.pre_process else self.input_tensor)


def make_batches(step: int, args):
    """A global batch of a regression task: learn a fixed random function of the input."""
    gen = torch.Generator().manual_seed(step)
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(args.hidden_size, args.hidden_size, generator=teacher) / args.hidden_size ** 0.5
    batches = []
    for _ in range(args.num_microbatches):
        length = args.seq_length if args.equal_lengths else int(
            torch.randint(args.seq_length // 4, args.seq_length + 1, (1,), generator=gen))
        x = torch.randn(length, args.micro_batch_size, args.hidden_size, generator=gen)
        batches.append((x, torch.tanh(x @ w)))
    return batches


def loss_func(target, output):
    loss = torch.nn.functional.mse_loss(output, target)
    return loss, {"loss": loss.detach()}


def forward_step(data_iterator, model):
    x, target = next(data_iterator)
    return model(x), functools.partial(loss_func, target)


def reference_losses(args, num_stages: int) -> list[float]:
    """The same training without pipelining: all stages, one process."""
    model = torch.nn.Sequential(*[build_stage(s, args) for s in range(num_stages)])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.train_iters):
        optimizer.zero_grad()
        total = 0.0
        for x, target in make_batches(step, args):
            loss = torch.nn.functional.mse_loss(model(x), target)
            (loss / args.num_microbatches).backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total / args.num_microbatches)
    return losses


def main():
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    pp, rank = dist.get_world_size(), dist.get_rank()
    vpp = args.virtual_stages
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    config = ModelParallelConfig(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        pipeline_dtype=torch.float32,
        variable_seq_lengths=not args.equal_lengths,
        batch_p2p_comm=args.p2p == "batched",
        overlap_p2p_comm=args.p2p == "overlapped")
    config.hidden_size = args.hidden_size
    num_stages = pp * vpp
    chunks = [Chunk(c * pp + rank, num_stages, config, args) for c in range(vpp)]
    optimizer = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=args.lr)
    forward_backward = get_forward_backward_func()
    if rank == pp - 1:
        print(f"pipeline size {pp}, {vpp} virtual stages per rank, {num_stages} stages, "
              f"{args.num_microbatches} microbatches of "
              f"{'equal' if args.equal_lengths else 'variable'} length, {args.p2p} p2p",
              flush=True)

    losses = []
    for step in range(args.train_iters):
        start = time.perf_counter()
        optimizer.zero_grad()
        batches = make_batches(step, args)
        reported = forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks] if vpp > 1 else iter(batches),
            model=chunks if vpp > 1 else chunks[0],
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size)
        optimizer.step()
        if rank == pp - 1:
            loss = sum(float(r["loss"]) for r in reported) / len(reported)
            losses.append(loss)
            tokens = sum(x.shape[0] for x, _ in batches) * args.micro_batch_size
            print(f" iteration {step + 1:4d}/{args.train_iters} | loss {loss:.6f} | "
                  f"tokens {tokens:5d} | {1000 * (time.perf_counter() - start):7.1f} ms",
                  flush=True)

    status = 0
    if rank == pp - 1:
        expected = reference_losses(args, num_stages)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
        verdict = "equal" if worst <= 1e-5 else "DIFFERENT"
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; pipelined and single-process loss "
              f"curves are {verdict} (largest relative difference {worst:.1e})", flush=True)
        status = 0 if worst <= 1e-5 else 1
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    raise SystemExit(status)


if __name__ == "__main__":
    main()
