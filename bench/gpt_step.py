"""One GPT training step on one GPU: this tree's model against megatron-core's and plain torch's.

    python bench/gpt_step.py --mcore-path DIR   # DIR holds an installed megatron-core wheel

Every implementation trains the same shape (default: 24 layers, hidden 2048, 16 heads,
sequence 2048, micro-batch 4, vocabulary 32000, about 1.3B parameters) in bf16 with learned
absolute positions, untied output layer, GELU MLP with biases and no dropout; one step is
forward, backward and a fused ``torch.optim.AdamW`` step over the bf16 parameters:

* ``ours``: this tree's ``GPTModel`` with the local backend (SDPA flash attention);
* ``mcore``: megatron-core's ``GPTModel`` with its local spec, run from ``--mcore-path`` in a
  process that cannot see this tree (both are the package ``megatron``); without apex or
  Transformer Engine it uses its unfused attention, as a user without them gets;
* ``torch``: a plain PyTorch GPT of the same shape on ``scaled_dot_product_attention``;
* ``torch-amp``: the same plain GPT with fp32 parameters under bf16 autocast, clipped to norm
  1 (fp32 master weights, gradients and Adam state, as the trainer keeps them);
* ``trainer`` and ``trainer-distopt``: ``pretrain_gpt.py``'s own step (``megatron.training``'s
  loop, DDP gradient buffers, the bf16 optimizer with fp32 main parameters, clipping, the log
  line with ``--log-throughput``), without and with ``--use-distributed-optimizer``; one
  micro-batch per step, or ``--microbatches`` (as a run with a larger global batch steps:
  tokens/s then counts them all, and the optimizer's share of a step shrinks);
* ``trainer-flat``: the trainer with ``--use-precision-aware-optimizer`` (Adam over the flat
  buffers, writing the bf16 weights in its kernel);
* ``trainer-fp8`` / ``trainer-fp8-rowwise``: the trainer with ``--fp8-format hybrid``
  (``--fp8-recipe tensorwise`` or ``rowwise``; torchao must be importable);
  ``trainer-flat-fp8`` with the flat Adam too (against ``trainer-flat``); the ``-delayed``
  rows with the default recipe, delayed scaling;
* ``trainer-flat-fp16-state`` / ``trainer-flat-fp8-state``: the flat Adam with fp16 main
  parameters and fp16 moments, or an fp8 first and fp16 second moment (issue 25's rows);
  ``trainer-flat-lean`` also with bf16 main gradients (every low-precision choice at once);
  ``trainer-fp8-lean`` that with FP8 (the fastest configuration, against plain PyTorch);
* ``trainer-varlen``: the trainer with ``--variable-seq-lengths`` on samples whose lengths are
  uniform in 50-100% of the sequence length, collated as the data loader does (each
  microbatch padded to its longest sample); its tokens/s counts real tokens only.

``--torch-compile`` adds compiled variants of ours and plain torch, ``--cuda-graph`` variants
whose forward and backward replay CUDA graphs (the most graphs can save in host work). Each
implementation runs in its own process; the step time is the median of ``--steps`` steps after
``--warmup``; with ``--rounds N`` every row runs N times, interleaved, and is rated by its median
round (rows of separate commands drifted by up to 4% on one GPU).
Tokens/s and MFU use megatron.training.flops (Megatron's formula) against ``--peak-tflops``.
``--quick`` (a tiny shape, two steps) checks that rows run; on a CPU it runs the trainer rows
over gloo (the suite does), and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import gpu_profile  # bench/, beside this script

REPO = Path(__file__).resolve().parents[1]
RESULT = "RESULT "
# The flat Adam with fp16 main parameters (issue 25's low-precision-state rows).
FP16_MAINS = ["--use-precision-aware-optimizer", "--main-params-dtype", "fp16"]
FP8 = ["--fp8-format", "hybrid"]
TENSORWISE = ["--fp8-recipe", "tensorwise"]
# Delayed scaling (the default recipe, as upstream's): one pass over each cast operand.
DELAYED = ["--fp8-recipe", "delayed"]
# pretrain_gpt.py's own step: name -> its own flags.
TRAINERS = {"trainer": [], "trainer-distopt": ["--use-distributed-optimizer"],
            "trainer-flat": ["--use-precision-aware-optimizer"],
            "trainer-varlen": ["--variable-seq-lengths"],
            "trainer-fp8": [*FP8, *TENSORWISE],
            "trainer-fp8-rowwise": [*FP8, "--fp8-recipe", "rowwise"],
            "trainer-fp8-delayed": [*FP8, *DELAYED],
            "trainer-flat-fp8": ["--use-precision-aware-optimizer", *FP8, *TENSORWISE],
            "trainer-flat-fp16-state": [*FP16_MAINS, "--exp-avg-dtype", "fp16",
                                        "--exp-avg-sq-dtype", "fp16"],
            "trainer-flat-fp8-state": [*FP16_MAINS, "--exp-avg-dtype", "fp8",
                                       "--exp-avg-sq-dtype", "fp16"],
            "trainer-flat-lean": [*FP16_MAINS, "--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype",
                                  "fp16", "--main-grads-dtype", "bf16"]}
# The fastest FP8 configuration: the lean optimizer state besides (a third less Adam traffic).
TRAINERS["trainer-fp8-lean"] = [*TRAINERS["trainer-flat-lean"], *FP8, *TENSORWISE]
TRAINERS["trainer-fp8-lean-delayed"] = [*TRAINERS["trainer-flat-lean"], *FP8, *DELAYED]
# Issue 25's targets: (numerator, denominator) -> least ratio of tokens/s. FP8 against bf16
# depends on the shape: 1.10 at 1.3B, 1.30 at the 7B-like one (hidden 4096).
BY_SHAPE = None
LOW_PRECISION_TARGETS = {("trainer-fp8", "trainer"): BY_SHAPE,
                         ("trainer-fp8-rowwise", "trainer"): BY_SHAPE,
                         ("trainer-flat-fp8", "trainer-flat"): BY_SHAPE,
                         ("trainer-fp8", "torch"): 1.15,
                         ("trainer-fp8-lean", "torch"): 1.15,
                         ("trainer-fp8-delayed", "trainer"): BY_SHAPE,
                         ("trainer-fp8-delayed", "torch"): 1.15,
                         ("trainer-fp8-lean-delayed", "torch"): 1.15,
                         ("trainer-flat-fp16-state", "ours"): 0.97,
                         ("trainer-flat-fp8-state", "ours"): 0.97,
                         ("trainer-flat-lean", "ours"): 0.97}


def is_variable(flags: list[str]) -> bool:
    return "--variable-seq-lengths" in flags


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPT shape the GPU benches share (default: about 1.3B parameters)."""
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=32000)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--impls", default="ours,trainer,trainer-distopt,trainer-flat,"
                        "trainer-varlen,mcore,torch,torch-amp",
                        help="comma-separated subset of ours, trainer, trainer-distopt, "
                        "trainer-flat, trainer-varlen, trainer-fp8, trainer-fp8-rowwise, "
                        "trainer-flat-fp8, trainer-flat-fp16-state, trainer-flat-fp8-state, "
                        "trainer-flat-lean, trainer-fp8-lean, "
                        "mcore, torch, "
                        "torch-amp, and "
                        "ours-unfused (no fusions) or ours-act (only the bias-activation "
                        "fusion)")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also run ours and plain torch under torch.compile")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also run ours and plain torch with forward and backward replayed "
                        "from CUDA graphs (torch.cuda.make_graphed_callables)")
    parser.add_argument("--mcore-path", type=Path,
                        help="directory with megatron-core installed (pip install --target)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of the GPU (H100/H200 SXM: 989)")
    parser.add_argument("--profile", type=Path,
                        help="write a kernel-time table of one step of each run into this "
                             "folder, with the GPU's busy time and its idle gaps by the kernel "
                             "that ended each, by the host operators that launched it and by "
                             "the host wait (a synchronization) that ended inside the gap")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the rows this many times, interleaved (each row, then each "
                        "again), and rate each row by its median round: the GPU's drift "
                        "between rows weighs less (default 1)")
    parser.add_argument("--microbatches", type=int, default=1,
                        help="micro-batches per step of the trainer rows (default 1; the "
                             "other rows step after each)")
    parser.add_argument("--trainer-args", default="",
                        help="more pretrain_gpt.py flags for the trainer rows, e.g. "
                        "'--clip-grad 0'")
    parser.add_argument("--pad-multiple", type=int,
                        help="round trainer-varlen's microbatch lengths up to a multiple of this "
                        "(default: the data loader's rule)")
    parser.add_argument("--sdpa-backend", choices=("flash", "cudnn", "efficient"),
                        help="restrict scaled_dot_product_attention to this kernel (default: "
                        "torch's choice)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny shape for two steps, also on a CPU (trainer rows only "
                        "there, over gloo): checks that the rows run, measures nothing")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag in ("microbatches", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.profile is not None and not on_gpu():
        parser.error("--profile times CUDA kernels: it needs a GPU")
    if args.quick:
        args.num_layers, args.hidden_size, args.num_attention_heads = 2, 64, 4
        args.seq_length, args.vocab_size, args.micro_batch_size = 64, 128, 2
        args.steps, args.warmup = 2, 1
    return args


# ---------------------------------------------------------------------------------------------
# Workers: each builds one model in its own process and times it.


def build_ours(args, torch, fuse_activation=True, fuse_dropout_add=True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=4 * args.hidden_size,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        bias_activation_fusion=fuse_activation, bias_dropout_fusion=fuse_dropout_add)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_length)
    model = Float16Module(config, model.cuda())  # as the trainer wraps it
    return model, lambda tokens, positions, labels: model(
        tokens, positions, None, labels=labels).mean()


def build_mcore(args, torch):
    import megatron.core
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if str(REPO) in os.path.abspath(megatron.core.__file__):
        raise RuntimeError("the mcore worker imported this tree's megatron, not the wheel")
    torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29531",
                                         rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    # No apex here: its fused softmax and gradient-accumulation kernels are not available.
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=4 * args.hidden_size,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=True, bias_dropout_fusion=True)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                     max_sequence_length=args.seq_length)
    model = Float16Module(config, model.cuda())  # as megatron's training loop wraps it
    return model, lambda tokens, positions, labels: model(
        tokens, positions, None, labels=labels).mean()


def build_torch(args, torch, amp=False):
    """bf16 parameters, or (``amp``) fp32 ones under bf16 autocast, the usual plain-PyTorch
    mixed precision: fp32 master weights and gradients, as the trainer keeps them."""
    nn, F = torch.nn, torch.nn.functional
    h, heads = args.hidden_size, args.num_attention_heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x):  # [b, s, h]
            b, s, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, heads, h // heads).unbind(2)
            context = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(context.transpose(1, 2).reshape(b, s, h))
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(args.vocab_size, h)
            self.position = nn.Embedding(args.seq_length, h)
            self.blocks = nn.ModuleList(Block() for _ in range(args.num_layers))
            self.norm = nn.LayerNorm(h)
            self.output = nn.Linear(h, args.vocab_size, bias=False)

        def forward(self, tokens, positions, labels):
            x = self.embed(tokens) + self.position(positions)
            for block in self.blocks:
                x = block(x)
            logits = self.output(self.norm(x))
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    model = GPT().to(device="cuda", dtype=torch.float32 if amp else torch.bfloat16)
    if not amp:
        return model, model

    def step_loss(tokens, positions, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(tokens, positions, labels)
    return model, step_loss


def loss_module(model, step_loss):
    """``step_loss`` as a module owning ``model``'s parameters, as make_graphed_callables takes
    it."""
    import torch

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, tokens, positions, labels):
            return step_loss(tokens, positions, labels)

    return Loss()


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def trainer_argv(args, flags: list[str]) -> list[str]:
    """pretrain_gpt.py's flags for the bench's shape: bf16 with fp32 main parameters and
    gradients, gradient clipping, Adam, ``--microbatches`` micro-batches per step."""
    argv = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads),
            "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.micro_batch_size * args.microbatches),
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(args.vocab_size - 1),
            "--position-embedding-type", "learned_absolute",
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--bf16", "--lr", "1e-4", "--clip-grad", "1.0",
            "--transformer-impl", "local", "--mock-data", "--log-throughput",
            "--train-iters", str(2 * args.steps + args.warmup), "--log-interval", str(args.steps),
            "--eval-iters", "0", "--distributed-backend", "nccl" if on_gpu() else "gloo"]
    return argv + flags + args.trainer_args.split()


def variable_length_batches(args, generator, multiple: int, count: int) -> list[dict]:
    """Microbatches of samples with lengths uniform in [seq/2, seq], collated as the data
    loader collates them (padded to the longest, no loss on the padding)."""
    import torch
    from megatron.training.data_loading import collate

    def sample():
        length = int(torch.randint(args.seq_length // 2, args.seq_length + 1, (),
                                   generator=generator))
        tokens = torch.randint(0, args.vocab_size, (length + 1,), generator=generator)
        return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": torch.ones(length),
                "position_ids": torch.arange(length)}

    return [collate([sample() for _ in range(args.micro_batch_size)], pad_id=0,
                    multiple_of=multiple, max_length=args.seq_length) for _ in range(count)]


def start_trainer(args, flags: list[str], port: str | None = None):
    """pretrain_gpt.py's model, optimizer, scheduler and step config for the bench's shape,
    in this process as rank 0 of 1 (its timers pretrain's: at the default
    --timing-log-level 0 the step's finer timers, which synchronize the device, do nothing).
    Its rendezvous store listens on ``port``, by default one free a moment ago (two benches
    at once, or a bench beside the tests, must not meet on a fixed one)."""
    if port is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    sys.path.insert(0, str(REPO))
    import pretrain_gpt
    from megatron.training import get_args, training
    from megatron.training.initialize import initialize_megatron
    from megatron.training.timers import Timers, set_timers

    initialize_megatron(argv=trainer_argv(args, flags))
    timers = Timers(get_args().timing_log_level, get_args().timing_log_option)
    set_timers(timers)
    model, optimizer, scheduler = training.setup_model_and_optimizer(pretrain_gpt.model_provider)
    return model, optimizer, scheduler, training.step_config(model, optimizer, timers)


def full_length_batch(args, generator) -> dict:
    """One microbatch of random tokens at the full sequence length, as the data loader gives."""
    import torch

    shape = (args.micro_batch_size, args.seq_length)
    return {"tokens": torch.randint(0, args.vocab_size, shape, generator=generator),
            "labels": torch.randint(0, args.vocab_size, shape, generator=generator),
            "loss_mask": torch.ones(shape),
            "position_ids": torch.arange(args.seq_length).expand(shape).contiguous()}


def run_trainer_worker(args, flags: list[str]) -> dict:
    """The step exactly as pretrain_gpt.py runs it on one GPU: DDP gradient buffers, the
    mixed-precision optimizer with clipping, loss averaging, timers and the log line."""
    import contextlib
    import io

    import torch

    model, optimizer, scheduler, config = start_trainer(args, flags)
    import pretrain_gpt
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training import get_args, training
    from megatron.training.data_loading import pad_multiple

    variable = is_variable(flags)
    generator = torch.Generator().manual_seed(1)
    if variable:
        multiple = args.pad_multiple or pad_multiple(get_args())
        pool = variable_length_batches(args, generator, multiple, args.steps)
    else:
        pool = [full_length_batch(args, generator)]

    gpu = on_gpu()
    synchronize = torch.cuda.synchronize if gpu else (lambda: None)

    def pin(batches):
        if not gpu:
            return batches
        return [{key: value.pin_memory() for key, value in batch.items()} for batch in batches]

    pool = pin(pool)
    served: list[dict] = []  # one microbatch per step

    def batches():
        while True:
            served.append(pool[len(served) % len(pool)])
            yield served[-1]

    def train(iteration: int, last: int) -> tuple[float, str]:
        get_args().train_iters = last
        log = io.StringIO()
        synchronize()
        start = time.perf_counter()
        with contextlib.redirect_stdout(log):
            training.train(pretrain_gpt.forward_step, model, optimizer, scheduler,
                           RerunDataIterator(batches()),
                           None, None, config, iteration, 0)
        synchronize()
        return (time.perf_counter() - start) / (last - iteration), log.getvalue()

    # Variable lengths: after the start-up steps (on full-length microbatches), a first pass
    # over the measured microbatches meets each length cold (attention plans and compiled
    # kernels made for it); the measured pass repeats them, as a long run repeats the
    # lengths its padding rule allows.
    cold_s = None
    if variable:
        measured_pool = pool
        pool = pin(variable_length_batches(args, generator, args.seq_length, 1))
        train(0, args.warmup)
        pool = measured_pool
        cold_s = train(args.warmup, args.warmup + len(pool))[0]
    else:
        train(0, args.warmup)
    first = len(served)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    step_s, log = train(first, first + args.steps)
    measured = served[first:]
    lengths = [[int(row.sum()) for row in batch["loss_mask"]] for batch in measured]
    if args.profile:
        last = first + args.steps
        gpu_profile.write_profile(args.profile, args.worker, torch,
                                  lambda: train(last, last + 2))
    # CUDA graphs' pools hold their tensors outside the allocated count: reserved then.
    graphs = gpu and get_args().enable_cuda_graph
    peak = 0 if not gpu else (torch.cuda.max_memory_reserved() if graphs
                              else torch.cuda.max_memory_allocated())
    logged = [line for line in log.splitlines() if "throughput per GPU" in line]
    losses = [float(line.split("lm loss:")[1].split("|")[0]) for line in logged]
    return {
        "parameters": sum(p.numel() for chunk in model for p in chunk.parameters()),
        "step_s": step_s, "step_s_min": step_s, "first_loss": losses[0], "last_loss": losses[-1],
        # Per microbatch, times the microbatches of a step.
        "real_tokens_per_step": args.microbatches * statistics.mean(
            sum(rows) for rows in lengths),
        "real_flops_per_step": args.microbatches * statistics.mean(
            step_flops(args, rows) for rows in lengths),
        "padded_tokens_per_step": args.microbatches * statistics.mean(
            batch["tokens"].numel() for batch in measured),
        "logged_tflops": float(logged[-1].split("(TFLOP/s/GPU):")[1].split("|")[0]),
        "peak_memory_gib": peak / 2**30,
        "peak_memory_reserved": graphs,
        "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
        **({"cold_step_s": cold_s, "pad_multiple": multiple,
            "distinct_lengths": len({batch["tokens"].shape[1] for batch in pool})}
           if variable else {}),
    }


def run_worker(args) -> dict:
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}.get(args.sdpa_backend)
    with sdpa_kernel(backend) if backend else contextlib.nullcontext():
        return run_implementation(args)


def run_implementation(args) -> dict:
    import torch

    impl, compiled = args.worker.split(":")
    if impl in TRAINERS:
        return {"impl": impl, "compiled": False, **run_trainer_worker(args, TRAINERS[impl])}
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    builders = {"ours": build_ours, "mcore": build_mcore, "torch": build_torch,
                "torch-amp": lambda *a: build_torch(*a, amp=True),
                "ours-unfused": lambda *a: build_ours(*a, False, False),
                "ours-act": lambda *a: build_ours(*a, True, False)}
    model, step_loss = builders[impl](args, torch)
    if compiled == "compiled":
        step_loss = torch.compile(step_loss)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    shape = (args.micro_batch_size, args.seq_length)
    tokens = torch.randint(0, args.vocab_size, shape, device="cuda", generator=generator)
    labels = torch.randint(0, args.vocab_size, shape, device="cuda", generator=generator)
    positions = torch.arange(args.seq_length, device="cuda").expand(shape).contiguous()
    if compiled == "graphed":
        # The upper bound of CUDA graphs at this shape: the whole forward and backward are
        # replayed, no host work per kernel (the optimizer step stays eager: a few launches).
        step_loss = torch.cuda.make_graphed_callables(
            loss_module(model, step_loss), (tokens, positions, labels))

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = step_loss(tokens, positions, labels)
        loss.backward()
        if impl == "torch-amp":  # the trainer's --clip-grad 1.0
            torch.nn.utils.clip_grad_norm_(parameters, 1.0, foreach=True)
        optimizer.step()
        return loss

    times, losses = [], []
    for index in range(args.warmup + args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        losses.append(float(loss))
        if index >= args.warmup:
            times.append(start.elapsed_time(end) / 1e3)
    if args.profile:
        gpu_profile.write_profile(args.profile, args.worker, torch, step)
    return {
        "impl": impl, "compiled": compiled == "compiled",
        "parameters": sum(p.numel() for p in parameters),
        "step_s": statistics.median(times), "step_s_min": min(times),
        "first_loss": losses[0], "last_loss": losses[-1],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    }


# ---------------------------------------------------------------------------------------------
# The driver: one process per run, then the table and the ratio lines.


def step_flops(args, lengths=None) -> float:
    """Model FLOPs of one step: one sample of each of ``lengths`` (default: micro-batch-size
    samples of the full sequence length)."""
    sys.path.insert(0, str(REPO))
    from megatron.training.flops import num_floating_point_operations

    def shape(length: int):
        return types.SimpleNamespace(
            hidden_size=args.hidden_size, seq_length=length, num_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads, kv_channels=None,
            num_query_groups=None, group_query_attention=False,
            ffn_hidden_size=4 * args.hidden_size, swiglu=False,
            padded_vocab_size=args.vocab_size, vocab_size=args.vocab_size)

    if lengths is None:
        lengths = [args.seq_length] * args.micro_batch_size
    return sum(num_floating_point_operations(shape(length), 1) for length in lengths)


def launch(worker: str, argv: list[str], args) -> dict:
    env = dict(os.environ)
    if worker.startswith("mcore"):
        if args.mcore_path is None:
            return {"error": "no --mcore-path given"}
        env["PYTHONPATH"] = str(args.mcore_path.resolve())
        cwd = args.mcore_path.resolve()  # keeps this tree off sys.path
    else:
        # Ahead of what the caller's PYTHONPATH holds (optional packages such as torchao).
        inherited = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *inherited])
        cwd = REPO
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv,
                           "--worker", worker], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    return {"error": f"exit code {done.returncode}: " + (done.stderr or done.stdout)[-1500:]}


def median_round(runs: list[dict]) -> dict:
    """A row's result over its rounds: the round of the median step time (the lower middle
    of an even count), or the first failure."""
    failed = [run for run in runs if "error" in run]
    if failed:
        return failed[0]
    return sorted(runs, key=lambda run: run["step_s"])[(len(runs) - 1) // 2]


def at_least_line(name: str, value: float, target: float, unit: str = "") -> str:
    if math.isnan(value):
        return f"{name}: not measured (a run above failed or was not selected)"
    verdict = "met" if value >= target else f"MISSED by {100 * (1 - value / target):.1f}%"
    return f"{name} = {value:.3f}{unit} (target >= {target:.2f}{unit}; {verdict})"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        print(RESULT + json.dumps(run_worker(args)), flush=True)
        return 0

    import torch

    if not torch.cuda.is_available():
        gpu_rows = [impl for impl in args.impls.split(",") if not impl.startswith("trainer")]
        if not args.quick or gpu_rows or args.torch_compile or args.cuda_graph:
            print("error: bench/gpt_step.py measures a GPU; no CUDA device is visible (on a "
                  "CPU only --quick with trainer rows runs, as a check)", file=sys.stderr)
            return 2
    flops = step_flops(args)
    tokens = args.micro_batch_size * args.seq_length
    workers = [f"{impl}:eager" for impl in args.impls.split(",")]
    for flag, variant in ((args.torch_compile, "compiled"), (args.cuda_graph, "graphed")):
        if flag:
            workers += [f"{impl}:{variant}" for impl in args.impls.split(",")
                        if impl in ("ours", "torch")]
    rounds: dict[str, list[dict]] = {worker: [] for worker in workers}
    print(f"GPT step, one GPU: {args.num_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads, seq {args.seq_length}, micro-batch "
          f"{args.micro_batch_size} ({args.microbatches} per trainer step), vocab "
          f"{args.vocab_size}; bf16, fwd+bwd+fused AdamW; "
          f"{time.strftime('%Y-%m-%d')}; command: python bench/gpt_step.py {' '.join(argv)}",
          flush=True)
    for round_ in range(args.rounds):
        for worker in workers:
            result = launch(worker, argv, args)
            rounds[worker].append(result)
            # ':eager' names the bench's own variant (no whole-step graph); trainer flags shown.
            label = (f"{worker} [{args.trainer_args}]" if worker.startswith("trainer")
                     and args.trainer_args else worker)
            label += f" #{round_ + 1}" if args.rounds > 1 else ""
            if "error" in result:
                print(f"{label:16s} FAILED: {result['error']}", flush=True)
                continue
            result["tokens_per_s"] = (result.get("real_tokens_per_step", tokens)
                                      / result["step_s"])
            result["flops"] = result.get("real_flops_per_step", flops)
            result["mfu"] = result["flops"] / result["step_s"] / (args.peak_tflops * 1e12)
            print(f"{label:16s} {result['step_s'] * 1e3:8.1f} ms/step  "
                  f"{result['tokens_per_s'] / 1e3:6.1f}k tokens/s  "
                  f"{result['flops'] / result['step_s'] / 1e12:6.1f} TFLOP/s  "
                  f"MFU {100 * result['mfu']:5.1f}%  "
                  f"{result['peak_memory_gib']:5.1f} GiB"
                  f"{' reserved' if result.get('peak_memory_reserved') else ''}  "
                  f"{result['parameters'] / 1e9:.3f}B params  "
                  f"loss {result['first_loss']:.3f}->{result['last_loss']:.3f}  "
                  f"({result['device']}, torch {result['torch']})", flush=True)
    results = {worker: median_round(runs) for worker, runs in rounds.items()}
    if args.rounds > 1:
        for worker, result in results.items():
            if "error" not in result:
                steps = [run["step_s"] for run in rounds[worker]]
                print(f"{worker:16s} median of {args.rounds} rounds "
                      f"{result['step_s'] * 1e3:8.1f} ms/step (rounds "
                      f"{', '.join(f'{1e3 * step:.1f}' for step in steps)}; spread "
                      f"{100 * (max(steps) - min(steps)) / result['step_s']:.1f}%)", flush=True)

    def throughput(worker):
        return results.get(worker, {}).get("tokens_per_s", math.nan)

    best_ours = max(throughput("ours:eager"),
                    throughput("ours:compiled") if args.torch_compile else -1.0,
                    throughput("ours:graphed") if args.cuda_graph else -1.0)
    print(at_least_line("ours/megatron-core-local tokens/s",
                        throughput("ours:eager") / throughput("mcore:eager"), 2.0))
    print(at_least_line("ours/plain-torch tokens/s (eager)",
                        throughput("ours:eager") / throughput("torch:eager"), 1.0))
    if args.torch_compile:
        print(at_least_line("ours/plain-torch tokens/s (compiled)",
                            throughput("ours:compiled") / throughput("torch:compiled"), 1.0))
    if args.cuda_graph:
        for impl in ("ours", "torch"):
            gain = throughput(f"{impl}:graphed") / throughput(f"{impl}:eager")
            print(f"{impl} with CUDA graphs/eager tokens/s = {gain:.3f} (what replaying the "
                  f"whole forward and backward saves in host work)")
    for trainer, flags in TRAINERS.items():
        if is_variable(flags):
            continue
        if f"{trainer}:eager" in results and "error" not in results[f"{trainer}:eager"]:
            result = results[f"{trainer}:eager"]
            print(at_least_line(f"{trainer}/ours tokens/s (trainer overhead)",
                                throughput(f"{trainer}:eager") / throughput("ours:eager"), 0.98))
            print(at_least_line(f"{trainer}/plain-torch tokens/s (eager)",
                                throughput(f"{trainer}:eager") / throughput("torch:eager"), 1.05))
            print(at_least_line(f"{trainer}/plain-torch-amp tokens/s (fp32 master weights)",
                                throughput(f"{trainer}:eager") / throughput("torch-amp:eager"),
                                1.05))
            measured = flops / result["step_s"] / 1e12
            print(f"{trainer} log line: {result['logged_tflops']:.1f} TFLOP/s/GPU, bench "
                  f"{measured:.1f} ({100 * (result['logged_tflops'] / measured - 1):+.1f}%)")
    for (numerator, denominator), least in LOW_PRECISION_TARGETS.items():
        over = [results.get(f"{name}:eager", {}) for name in (numerator, denominator)]
        if least is BY_SHAPE:
            least = 1.30 if args.hidden_size >= 4096 else 1.10
        if all("tokens_per_s" in result for result in over):
            print(at_least_line(f"{numerator}/{denominator} tokens/s",
                                throughput(f"{numerator}:eager")
                                / throughput(f"{denominator}:eager"), least))
            print(f"{numerator} peak memory {over[0]['peak_memory_gib']:.1f} GiB, "
                  f"{denominator} {over[1]['peak_memory_gib']:.1f} GiB")
    varlen = results.get("trainer-varlen:eager", {})
    if "error" not in varlen and "tokens_per_s" in varlen:
        ratio = throughput("trainer-varlen:eager") / throughput("trainer:eager")
        real = varlen["real_tokens_per_step"] / varlen["padded_tokens_per_step"]
        print(f"trainer-varlen/trainer tokens/s per real token = {ratio:.3f}, per computed "
              f"token {ratio / real:.3f} (lengths uniform in [{args.seq_length // 2}, "
              f"{args.seq_length}]; real tokens {100 * real:.1f}% of those computed, each "
              f"microbatch padded to its longest sample, rounded up to a multiple of "
              f"{varlen['pad_multiple']})")
        print(f"trainer-varlen first pass ({varlen['distinct_lengths']} lengths, each met for "
              f"the first time, with the fused kernels' one-time recompile for dynamic shapes): "
              f"{varlen['cold_step_s'] * 1e3:.1f} ms/step, against {varlen['step_s'] * 1e3:.1f} "
              f"once met")
    print(at_least_line("MFU ours (best)", 100 * best_ours * flops / tokens
                        / (args.peak_tflops * 1e12), 55.0, "%"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
