"""The optimizer step alone on one GPU: the default mixed-precision step against the flat Adam.

    python bench/optimizer_step.py [--use-distributed-optimizer]

Both optimizers step the same GPT (this tree's local model at bench/gpt_step.py's shape,
about 1.3B bf16 parameters in DDP buffers with fp32 gradients) as ``pretrain_gpt.py --bf16``
builds them: ``default`` is torch's fused AdamW over fp32 main parameters followed by the copy
into the bf16 weights, ``flat`` is ``--use-precision-aware-optimizer`` (one Triton pass per
buffer region that also writes the bf16 weights). A timed step is ``optimizer.step()`` as the
training loop calls it: the gradient norm, clipping and the update, on the same gradients
every step. The two arms alternate, round after round, in one process; each prints its median
step and the bytes per second its update moves (30 bytes per parameter: fp32 gradient, main
weight and two moments read, the last three written, and the bf16 weight written).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from gpt_step import add_shape_arguments

REPO = Path(__file__).resolve().parents[1]
BYTES_PER_PARAMETER = 30
DEVICE = "cuda"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--use-distributed-optimizer", action="store_true",
                        help="both arms with the distributed optimizer (one rank: one shard "
                        "per bucket)")
    return parser.parse_args(argv)


def build(args, flat: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=4 * args.hidden_size,
        bf16=True, params_dtype=torch.bfloat16)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_length)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer),
        Float16Module(config, model.to(DEVICE)))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=1e-4, weight_decay=0.1, clip_grad=1.0, bf16=True,
        use_distributed_optimizer=args.use_distributed_optimizer,
        use_precision_aware_optimizer=flat), [model])
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for buffer in model.buffers:
        buffer.grad_data.copy_(torch.randn(buffer.grad_data.shape, device=DEVICE,
                                           generator=generator))
    return model, optimizer


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/optimizer_step.py measures a GPU; no CUDA device is visible",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29541", rank=0,
                                         world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    arms = {"default": build(args, flat=False), "flat": build(args, flat=True)}
    parameters = sum(p.numel() for p in arms["default"][0].parameters())
    times: dict[str, list[float]] = {name: [] for name in arms}
    for round_index in range(args.warmup + args.steps):
        for name, (_, optimizer) in arms.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            success, _, _ = optimizer.step()
            end.record()
            torch.cuda.synchronize()
            assert success
            if round_index >= args.warmup:
                times[name].append(start.elapsed_time(end) / 1e3)
    print(f"optimizer step, {parameters / 1e9:.3f}B bf16 parameters, fp32 gradients, clip 1.0"
          f"{', distributed optimizer' if args.use_distributed_optimizer else ''}; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}; command: python "
          f"bench/optimizer_step.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    medians = {name: statistics.median(found) for name, found in times.items()}
    for name, seconds in medians.items():
        print(f"{name:8s} {seconds * 1e3:7.2f} ms/step (min {min(times[name]) * 1e3:.2f}), "
              f"{BYTES_PER_PARAMETER * parameters / seconds / 1e12:.2f} TB/s at "
              f"{BYTES_PER_PARAMETER} bytes per parameter")
    print(f"flat/default step time = {medians['flat'] / medians['default']:.3f}")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
