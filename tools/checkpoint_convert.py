"""Convert a GPT checkpoint between this tree's format, upstream's torch / torch_dist, and a
Hugging Face Llama-style safetensors model, offline in one process.

    python tools/checkpoint_convert.py --input DIR --output DIR --output-format FORMAT \\
        [--target-tp N --target-pp N --target-vpp N] [--te-names]

``--input`` is a save root (with latest_checkpointed_iteration.txt) or one iteration
directory, of any format and any layout (detected). Outputs: ``layout_free`` and
``torch_dist`` (layout-free on disk: any layout loads them), ``torch`` (upstream's per-rank files
at ``--target-tp`` x ``--target-pp`` [x ``--target-vpp``]; ``--te-names`` for a Transformer
Engine spec model) and ``hf`` (config.json + model.safetensors; needs ``safetensors``). The
model weights, iteration, consumed samples, scheduler and args carry over; optimizer state
does not.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.checkpoint import hf_export, upstream_dist, upstream_torch  # noqa: E402
from megatron.training.checkpoint.errors import CheckpointError  # noqa: E402
from megatron.training.checkpoint.formats import TRACKER, open_checkpoint  # noqa: E402
from megatron.training.checkpoint.upstream_names import split_layer  # noqa: E402

OUTPUT_FORMATS = ("layout_free", "torch", "torch_dist", "hf")


def progress(items, description: str):
    """tqdm where installed, else a plain counter on stderr."""
    items = list(items)
    try:
        from tqdm import tqdm
    except ImportError:
        def counted():
            for number, item in enumerate(items, start=1):
                print(f"\r{description}: {number}/{len(items)}", end="", file=sys.stderr,
                      flush=True)
                yield item
            print(file=sys.stderr)
        return counted()
    return tqdm(items, desc=description)


def read_all(source) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in progress(sorted(source.shapes), "reading"):
        tensors.update(source.read([name]))
    return tensors


def iteration_dir(output: str, iteration: int) -> str:
    return os.path.join(output, f"iter_{iteration:07d}")


def write_tracker(output: str, iteration: int) -> None:
    with open(os.path.join(output, TRACKER), "w") as f:
        f.write(str(iteration))


def write_layout_free(output: str, source, tensors: dict[str, torch.Tensor]) -> None:
    from megatron.training.checkpoint import dcp_chunks
    from megatron.training.checkpoint.layout_free import FORMAT_VERSION

    folder = iteration_dir(output, source.iteration)
    dcp_chunks.save(tensors, os.path.join(folder, "model"))
    torch.save({"format_version": FORMAT_VERSION, "iteration": source.iteration,
                "consumed_samples": source.consumed_samples,
                "opt_param_scheduler": source.scheduler_state, "args": source.args},
               os.path.join(folder, "common.pt"))
    write_tracker(output, source.iteration)


def write_torch_dist(output: str, source, tensors: dict[str, torch.Tensor]) -> None:
    num_layers = 1 + max((split_layer(n)[0] for n in tensors if split_layer(n)), default=-1)
    state: dict = {}
    for name, tensor in tensors.items():
        upstream_dist.add_tensor(state, name, tensor, num_layers)
    for index in range(num_layers):
        upstream_dist.add_layer_extra_state(state, index, num_layers)
    upstream_dist.write(state, iteration_dir(output, source.iteration),
                        upstream_dist.common_state(source.iteration, source.args,
                                                   source.consumed_samples,
                                                   source.scheduler_state))
    write_tracker(output, source.iteration)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="save root or iteration directory")
    parser.add_argument("--output", required=True, help="save root to write (created)")
    parser.add_argument("--output-format", required=True, choices=OUTPUT_FORMATS)
    parser.add_argument("--target-tp", type=int, default=1, help="torch output: tensor parallel")
    parser.add_argument("--target-pp", type=int, default=1, help="torch output: pipeline size")
    parser.add_argument("--target-vpp", type=int, default=None,
                        help="torch output: virtual pipeline stages per rank")
    parser.add_argument("--te-names", action="store_true",
                        help="torch output: Transformer Engine spec names")
    args = parser.parse_args(argv)
    try:
        source = open_checkpoint(args.input)
        if args.output_format == "hf":
            reason = hf_export.why_not_llama(source.args)
            if reason:
                raise ValueError(f"{args.input} does not map onto a Hugging Face Llama: {reason}")
        print(f"{source.path}: {source.format} format, iteration {source.iteration}, "
              f"{len(source.shapes)} tensors", file=sys.stderr)
        tensors = read_all(source)
        os.makedirs(args.output, exist_ok=True)
        if args.output_format == "layout_free":
            write_layout_free(args.output, source, tensors)
        elif args.output_format == "torch_dist":
            write_torch_dist(args.output, source, tensors)
        elif args.output_format == "torch":
            upstream_torch.write(iteration_dir(args.output, source.iteration), tensors,
                                 tp=args.target_tp, pp=args.target_pp, vpp=args.target_vpp,
                                 args=source.args, iteration=source.iteration,
                                 scheduler_state=source.scheduler_state, te_names=args.te_names,
                                 progress=lambda ranks: progress(ranks, "writing ranks"))
            write_tracker(args.output, source.iteration)
        else:
            hf_export.write_llama(args.output, tensors, source.args)
    except (CheckpointError, ValueError) as error:
        print(f"checkpoint_convert: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.output_format} checkpoint to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
