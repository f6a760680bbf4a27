"""Loss curves of bf16, FP8 and low-precision Adam state on real text, and their final ratios.

    python tools/make_text_corpus.py DATA /path/to/site-packages     # once: a real-text corpus
    python bench/loss_curves.py --data DATA [--steps 300] [--png out.png]

Each variant trains the same GPT (default about 125M parameters: 12 layers, hidden 768, 12
heads, sequence 1024, global batch 32) from the same seeds on the same batches with
``pretrain_gpt.py`` on one device, ``--bf16``, the flat Adam's fp32 state as the baseline:

* ``bf16``: ``--use-precision-aware-optimizer`` (fp32 moments);
* ``fp8``: the same with ``--fp8-format hybrid`` (torchao, tensorwise);
* ``fp8-rowwise``: ``--fp8-recipe rowwise``;
* ``fp8-delayed``: ``--fp8-recipe delayed`` (upstream's defaults: the newest amax, no margin);
* ``fp16-state``: fp16 first and second moments;
* ``fp8-state``: an fp8 first and fp16 second moment;
* ``lean-state``: fp16 moments, fp16 main parameters and bf16 main gradients (every
  low-precision choice of ``--use-precision-aware-optimizer`` at once);
* ``fp8-lean-delayed``: ``lean-state`` with FP8 and delayed scaling (the fastest
  configuration of ``bench/gpt_step.py``).

It prints the final loss of each (the mean of the last ``--final-window`` steps, which evens
out batch-to-batch noise) and its ratio to ``bf16``'s, against issue 25's bounds (FP8 within
1.5%, low-precision state within 0.5%), and draws the curves with matplotlib.

One run per variant does not decide those bounds: two bf16 runs from the same seed, on the same
batches, part after some 50 steps (the GPU's kernels are not bit-reproducible and training
amplifies a last-bit difference) and ended 1-3% apart on an H200 (docs/performance.md). So
``--repeats R`` trains each variant R times, run ``r`` with seed ``1234 + r`` (its own
initialization and data order, the same for every variant), and compares the variants' mean
final losses: the ratio is printed with twice its standard error, and a verdict is given only
where that band lies inside the bound or outside it (else ``unresolved``: more repeats).

``--parallel N`` trains N runs at once (a 125M model leaves most of an H200 idle; the losses
do not depend on what else runs). Each curve is written to ``--png``'s ``.json`` as its run
ends (keys ``variant`` or, with repeats, ``variant#r``), so a run cut short keeps those that
finished, and each run's output to ``<png>-logs/``. On a CPU (``--distributed-backend gloo``,
small ``--steps`` and shape) it is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([0-9.E+-]+) \|")
FLAT = ["--use-precision-aware-optimizer"]
VARIANTS = {
    "bf16": FLAT,
    "fp8": [*FLAT, "--fp8-format", "hybrid"],
    "fp8-rowwise": [*FLAT, "--fp8-format", "hybrid", "--fp8-recipe", "rowwise"],
    "fp8-delayed": [*FLAT, "--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    "fp16-state": [*FLAT, "--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype", "fp16"],
    "fp8-state": [*FLAT, "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "fp16"],
    "lean-state": [*FLAT, "--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype", "fp16",
                   "--main-params-dtype", "fp16", "--main-grads-dtype", "bf16"],
}
VARIANTS["fp8-lean-delayed"] = [*VARIANTS["lean-state"], "--fp8-format", "hybrid",
                                "--fp8-recipe", "delayed"]
SEED = 1234
# Issue 25: final loss within this share of bf16's.
BOUNDS = {"fp8": 0.015, "fp8-rowwise": 0.015, "fp8-delayed": 0.015, "fp8-lean-delayed": 0.015,
          "fp16-state": 0.005, "fp8-state": 0.005, "lean-state": 0.005}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, required=True,
                        help="a folder made by tools/make_text_corpus.py")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--final-window", type=int, default=20)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-attention-heads", type=int, default=12)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--distributed-backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--png", type=Path, default=REPO / "bench" / "out" / "loss_curves.png")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--parallel", type=int, default=1,
                        help="runs trained at the same time (default 1)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per variant, run r with seed 1234 + r (default 1)")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    for flag in ("parallel", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    for name in ("corpus_text_document.bin", "tokenizer.model"):
        if not (args.data / name).is_file():
            parser.error(f"{args.data} holds no {name}: make it with tools/make_text_corpus.py")
    return args


def train_argv(args, seed: int) -> list[str]:
    return [
        "--distributed-backend", args.distributed_backend, "--transformer-impl", "local",
        "--bf16", "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(args.steps), "--lr", str(args.lr), "--min-lr", str(args.lr / 10),
        "--lr-decay-style", "cosine", "--lr-warmup-iters", str(max(1, args.steps // 20)),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta2", "0.95",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", str(seed),
        "--log-interval", "1", "--eval-interval", str(10 * args.steps), "--eval-iters", "1",
        "--num-workers", "1", "--data-path", str(args.data / "corpus_text_document"),
        "--split", "99,1,0", "--tokenizer-type", "Llama2Tokenizer",
        "--tokenizer-model", str(args.data / "tokenizer.model"),
        "--data-cache-path", str(args.data / "cache")]


def run_name(name: str, repeat: int, repeats: int) -> str:
    return name if repeats == 1 else f"{name}#{repeat}"


def run_variant(args, name: str, repeat: int) -> dict[int, float]:
    """Train one variant once; its output goes to ``<png>-logs/<run name>.log`` as it runs (a
    run cut short still shows how far each got)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "1", str(REPO / "pretrain_gpt.py"),
               *train_argv(args, SEED + repeat), *VARIANTS[name]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    label = run_name(name, repeat, args.repeats)
    log = logs_dir(args) / f"{label.replace('#', '-')}.log"
    with open(log, "w") as stream:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=stream,
                              stderr=subprocess.STDOUT, timeout=args.timeout_s)
    output = log.read_text()
    if done.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {done.returncode}), {log}:\n{output[-3000:]}")
    return {int(i): float(v) for i, v in LOSS.findall(output)}


def logs_dir(args) -> Path:
    return args.png.with_name(f"{args.png.stem}-logs")


def final_loss(curve: dict[int, float], window: int) -> float:
    last = sorted(curve)[-window:]
    return sum(curve[i] for i in last) / len(last)


def compare(finals: list[float], reference: list[float], bound: float) -> tuple[float, str]:
    """The ratio of ``finals``' mean to ``reference``'s, and its text: with several runs each,
    twice the ratio's standard error besides, and a verdict only where that band is wholly
    inside the bound (met) or outside it (MISSED)."""
    ratio = statistics.fmean(finals) / statistics.fmean(reference)
    if min(len(finals), len(reference)) < 2:
        verdict = "met" if abs(ratio - 1) <= bound else "MISSED"
        return ratio, (f"{ratio:.4f} (target within {100 * bound:.1f}%; {verdict}; one run "
                       f"of one side: --repeats to weigh it against run-to-run noise)")
    relative = math.sqrt(sum(statistics.variance(runs) / len(runs) / statistics.fmean(runs) ** 2
                             for runs in (finals, reference)))
    band = 2 * ratio * relative
    if abs(ratio - 1) + band <= bound:
        verdict = "met"
    elif abs(ratio - 1) - band > bound:
        verdict = "MISSED"
    else:
        verdict = "unresolved: the noise band crosses the bound"
    return ratio, (f"{ratio:.4f} +- {band:.4f} (target within {100 * bound:.1f}%; {verdict}; "
                   f"means of {len(finals)} and {len(reference)} runs)")


def draw(curves: dict[str, list[dict[int, float]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for index, (name, runs) in enumerate(curves.items()):
        for repeat, curve in enumerate(runs):
            steps = sorted(curve)
            axes.plot(steps, [curve[i] for i in steps], color=f"C{index % 10}", linewidth=1,
                      alpha=1.0 if repeat == 0 else 0.5, label=name if repeat == 0 else None)
    axes.set_xlabel("iteration")
    axes.set_ylabel("lm loss")
    axes.set_yscale("log")
    axes.legend()
    axes.grid(True, alpha=0.3)
    figure.savefig(png, dpi=120, bbox_inches="tight")


def main(argv=None) -> int:
    args = parse_args(argv)
    names = args.variants.split(",")
    record = args.png.with_suffix(".json")
    logs_dir(args).mkdir(parents=True, exist_ok=True)
    finished, failed = {}, []
    # Each repeat of every variant before the next repeat: a run cut short has them all.
    jobs = [(name, repeat) for repeat in range(args.repeats) for name in names]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        runs = {pool.submit(run_variant, args, *job): job for job in jobs}
        for run in as_completed(runs):
            label = run_name(*runs[run], args.repeats)
            try:
                finished[label] = run.result()
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                failed.append(label)
                print(f"{label}: FAILED: {err}", flush=True)
                continue
            record.write_text(json.dumps(finished, indent=1))
            print(f"{label}: {len(finished[label])} steps, final loss "
                  f"{final_loss(finished[label], args.final_window):.4f}", flush=True)
    curves = {name: [finished[label] for label in
                     (run_name(name, r, args.repeats) for r in range(args.repeats))
                     if label in finished] for name in names}
    curves = {name: runs for name, runs in curves.items() if runs}
    finals = {name: [final_loss(curve, args.final_window) for curve in runs]
              for name, runs in curves.items()}
    if len(finals.get("bf16", [])) > 1:
        spread = (max(finals["bf16"]) - min(finals["bf16"])) / statistics.fmean(finals["bf16"])
        print(f"bf16's own runs: final losses {', '.join(f'{x:.4f}' for x in finals['bf16'])}"
              f" (spread {100 * spread:.2f}% of their mean)")
    if "bf16" in finals:
        for name, bound in BOUNDS.items():
            if name in finals:
                _, text = compare(finals[name], finals["bf16"], bound)
                print(f"{name}/bf16 final loss = {text}")
    draw(curves, args.png)
    print(f"curves: {args.png} (losses: {record})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
