"""Convert a GPT checkpoint between this tree's format, upstream's torch / torch_dist, and a
Hugging Face Llama-style safetensors model, offline in one process.

    python tools/checkpoint_convert.py --input DIR --output DIR --output-format FORMAT \\
        [--target-tp N --target-pp N --target-vpp N] [--te-names] [--target-dp N] \\
        [--no-optimizer]

``--input`` is a save root (with latest_checkpointed_iteration.txt) or one iteration
directory, of any format and any layout (detected); every file is read as ``--load`` reads it,
without running anything a file names. Outputs: ``layout_free`` and ``torch_dist``
(layout-free on disk: any layout loads them), ``torch`` (upstream's per-rank files at
``--target-tp`` x ``--target-pp`` [x ``--target-vpp``], written by the code ``--save
--ckpt-format torch`` uses; ``--te-names`` for a Transformer Engine spec model) and ``hf``
(config.json + model.safetensors; needs ``safetensors``). The model weights, iteration,
consumed samples, scheduler and args carry over, and so does the optimizer state where the
input holds one this tree reads (unless ``--no-optimizer``): Adam's moments, fp32 main
parameters, the step and the groups' settings, in the plain optimizers' layout, or for
``torch`` with ``--target-dp N`` in the distributed optimizer's ``distrib_optim.pt`` for N
data-parallel ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.checkpoint import (  # noqa: E402
    dist_optimizer_common, hf_export, legacy_convert, sharded_objects, upstream_dist,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.dist_checkpointing.errors import CheckpointError  # noqa: E402
from megatron.training.checkpoint.formats import TRACKER, open_checkpoint  # noqa: E402
from megatron.training.checkpoint.legacy_convert import WholeOptimizer  # noqa: E402
from megatron.training.checkpoint.source import (  # noqa: E402
    OPTIMIZER_PREFIX, split_optimizer_key,
)
from megatron.core.dist_checkpointing.upstream_names import split_layer  # noqa: E402

OUTPUT_FORMATS = ("layout_free", "torch", "torch_dist", "hf")
STEP = "step"


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


def read_optimizer(source) -> Optional[WholeOptimizer]:
    """The input's optimizer state, whole; None where it holds none this tree reads."""
    keys = sorted(source.optimizer_shapes())
    if not keys:
        return None
    tensors = {}
    for key in progress(keys, "reading optimizer state"):
        tensors.update(source.read_optimizer([key]))
    steps = {float(tensors.pop(key)) for key in keys if split_optimizer_key(key)[0] == STEP}
    if len(steps) != 1:
        raise ValueError(f"{source.path}: its optimizer state holds step counts "
                         f"{sorted(steps)}; upstream's formats keep one (add --no-optimizer)")
    return WholeOptimizer(tensors, steps.pop(), list(source.param_group_settings),
                          source.grad_scaler_state)


def iteration_dir(output: str, iteration: int) -> str:
    return os.path.join(output, f"iter_{iteration:07d}")


def write_tracker(output: str, iteration: int) -> None:
    with open(os.path.join(output, TRACKER), "w") as f:
        f.write(str(iteration))


def write_layout_free(output: str, source, tensors: dict[str, torch.Tensor],
                      optimizer: Optional[WholeOptimizer]) -> None:
    from megatron.core.dist_checkpointing.strategies import dcp_chunks
    from megatron.training.checkpoint.layout_free import FORMAT_VERSION
    from megatron.training.checkpoint.source import optimizer_key

    folder = iteration_dir(output, source.iteration)
    dcp_chunks.save(tensors, os.path.join(folder, "model"))
    common = {"format_version": FORMAT_VERSION, "iteration": source.iteration,
              "consumed_samples": source.consumed_samples,
              "opt_param_scheduler": source.scheduler_state, "args": source.args}
    if optimizer is not None:
        steps = {optimizer_key(STEP, split_optimizer_key(key)[1]): torch.tensor(optimizer.step)
                 for key in optimizer.tensors}
        dcp_chunks.save({**optimizer.tensors, **steps}, os.path.join(folder, "optimizer"))
        common["param_group_settings"] = optimizer.settings
        if optimizer.grad_scaler:
            common["grad_scaler"] = optimizer.grad_scaler
    torch.save(common, os.path.join(folder, "common.pt"))
    write_tracker(output, source.iteration)


def _add_rank_objects(state: dict, source) -> bool:
    """Upstream's per-rank sharded objects for the (pp, tp) layout the saved arguments name:
    the only layout at which upstream loads them, and then it requires every one. The rerun
    state is the source's or a fresh one; the RNG states only where the source has them for
    every rank (returns whether it had)."""
    grid = sharded_objects.saved_grid(source.args)
    ranks = [(p, t) for p in range(grid[0]) for t in range(grid[1])]
    rngs = {rank: source.rng_states(*rank) for rank in ranks}
    for rank in ranks:
        rerun = source.rerun_state(*rank)
        sharded_objects.add_object(state, sharded_objects.RERUN_STATE,
                                   get_rerun_state_machine().state_dict() if rerun is None
                                   else rerun, rank, grid)
    if any(rng is None for rng in rngs.values()):
        return False
    for rank, rng in rngs.items():
        sharded_objects.add_object(state, sharded_objects.RNG_STATE, rng, rank, grid)
    return True


def write_torch_dist(output: str, source, tensors: dict[str, torch.Tensor],
                     optimizer: Optional[WholeOptimizer]) -> None:
    num_layers = 1 + max((split_layer(n)[0] for n in tensors if split_layer(n)), default=-1)
    state: dict = {}
    for name, tensor in tensors.items():
        upstream_dist.add_tensor(state, name, tensor, num_layers)
    for index in range(num_layers):
        upstream_dist.add_layer_extra_state(state, index, num_layers)
    optimizer_common = None
    if optimizer is not None:  # upstream's plain optimizers' layout
        for key, tensor in optimizer.tensors.items():
            kind, name = split_optimizer_key(key)
            upstream_dist.add_tensor(state, name, tensor, num_layers,
                                     prefix=f"{OPTIMIZER_PREFIX}{kind}.")
        half = any(dtype in (torch.float16, torch.bfloat16) for dtype in source.dtypes.values())
        optimizer_common = dist_optimizer_common.optimizer_common_state(
            optimizer.settings, torch.tensor(optimizer.step), mixed_precision=half,
            grad_scaler_state=optimizer.grad_scaler)
    saved_args = dict(source.args)
    if not _add_rank_objects(state, source):
        saved_args["no_save_rng"] = True  # upstream then starts its RNGs afresh instead of failing
    upstream_dist.write(state, iteration_dir(output, source.iteration),
                        upstream_dist.common_state(source.iteration, saved_args,
                                                   source.consumed_samples,
                                                   source.scheduler_state, optimizer_common))
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
    parser.add_argument("--target-dp", type=int, default=None,
                        help="torch output: the optimizer state as the distributed optimizer "
                             "saves it for this many data-parallel ranks (distrib_optim.pt)")
    parser.add_argument("--no-optimizer", action="store_true",
                        help="leave the optimizer state out")
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
        optimizer = None
        if not args.no_optimizer and args.output_format != "hf":
            optimizer = read_optimizer(source)
            if optimizer is None:
                print(f"{source.path}: no optimizer state this tree reads ("
                      f"{source.optimizer_problem()}); writing the model alone", file=sys.stderr)
        if args.target_dp is not None and (args.output_format != "torch" or optimizer is None):
            raise ValueError("--target-dp lays out optimizer state in torch output; this "
                             "conversion writes none")
        os.makedirs(args.output, exist_ok=True)
        if args.output_format == "layout_free":
            write_layout_free(args.output, source, tensors, optimizer)
        elif args.output_format == "torch_dist":
            write_torch_dist(args.output, source, tensors, optimizer)
        elif args.output_format == "torch":
            legacy_convert.write(iteration_dir(args.output, source.iteration), tensors,
                                 tp=args.target_tp, pp=args.target_pp, vpp=args.target_vpp,
                                 args=source.args, iteration=source.iteration,
                                 scheduler_state=source.scheduler_state, te_names=args.te_names,
                                 optimizer=optimizer, data_parallel_size=args.target_dp,
                                 progress=lambda ranks: progress(ranks, "writing ranks"))
            write_tracker(args.output, source.iteration)
            print("note: the torch output holds no RNG state; Megatron-LM resumes it with "
                  "--no-load-rng (or --finetune), this tree without", file=sys.stderr)
        else:
            hf_export.write_llama(args.output, tensors, source.args)
    except (CheckpointError, ValueError) as error:
        print(f"checkpoint_convert: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.output_format} checkpoint to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
