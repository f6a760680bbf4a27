"""``pretrain()``: start-up, model and optimizer, data, the training loop, evaluation, checkpoints.

Upstream Megatron-LM's entry points and log line; the model, the pipeline schedules, DDP and
the optimizer are megatron.core's. Before any model exists the pipeline layout is proven with
the verifier (``pipeline_parallel.verify``) against a model of the job's transport (gloo or
NCCL): a layout that would cross or deadlock is refused with the verifier's report.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from datetime import datetime
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import flight_recorder, get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communicator import set_debug_tags
from megatron.core.pipeline_parallel.verify import Layout, VerificationError, verify
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config
from megatron.training import metrics_writers
from megatron.training.checkpoint import pending
from megatron.training.checkpoint.errors import CheckpointError
from megatron.training.arguments import ArgumentError, validate_training_args
from megatron.training.config_builders import ddp_config_from_args, optimizer_config_from_args
from megatron.training.data_loading import build_data_loader, cyclic_iter
from megatron.training.flops import num_floating_point_operations
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.initialize import initialize_megatron
from megatron.training.lr_schedule import optimizer_param_scheduler_from_args
from megatron.training.rendezvous import StartupError
from megatron.training.signals import SigtermWatcher
from megatron.training.timers import Timers
from megatron.training.utils import print_rank_0, print_rank_last


def _checkpointing():
    """The checkpoint driver, imported on first use: torch.distributed.checkpoint is most of
    its import time, which a run that neither loads nor saves need not pay on every rank."""
    from megatron.training import checkpointing

    return checkpointing


def _failures_end_the_run(run: Callable) -> Callable:
    """A checkpoint that cannot be loaded (bad files) or written (a full disk) ends the run with
    its one-line reason and exit code 2, as bad input does, instead of a deep traceback. Any
    other error writes the p2p flight record first (a peer that died fails a collective too)."""
    @functools.wraps(run)
    def guarded(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except CheckpointError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except Exception as error:
            path = flight_recorder.get_flight_recorder().dump_for_error(error)
            if path is not None:
                print(f"p2p flight recorder: the run ended with {type(error).__name__}; flight "
                      f"record: {path}; run `python tools/diagnose_hang.py "
                      f"{os.path.dirname(path)}` once every rank has written its record",
                      file=sys.stderr, flush=True)
            raise
    return guarded


@_failures_end_the_run
def pretrain(train_valid_test_dataset_provider: Callable, model_provider: Callable,
             model_type: ModelType, forward_step_func: Callable,
             process_non_loss_data_func: Optional[Callable] = None,
             extra_args_provider: Optional[Callable] = None, args_defaults: Optional[dict] = None,
             get_embedding_ranks=None, get_position_embedding_ranks=None,
             non_loss_data_func=None) -> None:
    """Train a model as the command line describes; see the module docstring."""
    del non_loss_data_func
    try:
        initialize_megatron(extra_args_provider=extra_args_provider,
                            args_defaults=args_defaults or {},
                            get_embedding_ranks=get_embedding_ranks,
                            get_position_embedding_ranks=get_position_embedding_ranks)
        args = get_args()
        validate_training_args(args)
        preflight_pipeline_check(args)
    except (ArgumentError, StartupError, VerificationError) as error:
        # Bad input is the user's to fix: say so in one line, without a traceback.
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    _start_p2p_diagnostics(args)
    metrics_writers.start(args)  # a missing optional package warns here, not at iteration 1
    timers = Timers(log_level=1)
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, model_type)
    config = step_config(model, optimizer, timers)

    iteration, consumed = 0, 0
    if args.load or args.pretrained_checkpoint:
        iteration, consumed = _checkpointing().load_checkpoint(model, optimizer, scheduler)
    train_iterator, valid_iterator, test_iterator = build_train_valid_test_data_iterators(
        train_valid_test_dataset_provider, consumed, len(model))
    print_rank_0(f"> starting training at iteration {iteration} ({consumed} samples consumed)")
    iteration, consumed = train(forward_step_func, model, optimizer, scheduler, train_iterator,
                                valid_iterator, process_non_loss_data_func, config, iteration,
                                consumed, timers)
    if args.save and iteration and (args.save_interval is None or iteration % args.save_interval):
        _checkpointing().save_checkpoint(iteration, model, optimizer, scheduler, consumed)
    if test_iterator is not None and args.eval_iters > 0:
        evaluate_and_print_results("test", forward_step_func, test_iterator, model, iteration,
                                   process_non_loss_data_func, config)
    _leave_together()


def _leave_together() -> None:
    """End every rank's process groups once all ranks are done: a rank whose connections close
    while a peer's transport threads still read from them can abort that peer at exit."""
    pending.wait_for_pending()  # an --async-save checkpoint still being written
    if not dist.is_initialized():
        return
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def preflight_pipeline_check(args) -> None:
    """Refuse a pipeline layout that would cross tensors or deadlock on the job's transport,
    before building anything: every rank's schedule, as the executor runs it, against a model
    of gloo or NCCL (a second or two at start-up for the largest layouts)."""
    if args.pipeline_model_parallel_size == 1:
        return
    mode = ("overlapped" if args.overlap_p2p_comm else
            "batched" if args.batch_p2p_comm else "unbatched")
    verify(Layout(args.pipeline_model_parallel_size,
                  args.virtual_pipeline_model_parallel_size or 1, num_microbatches(args),
                  args.variable_seq_lengths, mode, args.microbatch_group_size_per_vp_stage),
           transport=args.distributed_backend)


def _start_p2p_diagnostics(args) -> None:
    set_debug_tags(args.p2p_debug_tags)
    if args.pipeline_model_parallel_size > 1:
        timeout = args.p2p_timeout_seconds or 60.0 * args.distributed_timeout_minutes
        dump_dir = args.p2p_dump_dir or os.path.join(args.save or ".", "p2p_hang")
        flight_recorder.start_watchdog(timeout, dump_dir)


def num_microbatches(args) -> int:
    return args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def _device(args) -> torch.device:
    if args.distributed_backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_model(model_provider_func: Callable, model_type=ModelType.encoder_or_decoder,
              wrap_with_ddp: bool = True) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual stage), on the device, wrapped for DDP."""
    args = get_args()
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for chunk in range(vpp or 1):
        if vpp:
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)
        module = model_provider_func(pre_process=parallel_state.is_pipeline_first_stage(),
                                     post_process=parallel_state.is_pipeline_last_stage())
        module.model_type = model_type
        chunks.append(module)
    if vpp:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    device = _device(args)
    chunks = [chunk.to(device) for chunk in chunks]
    if args.fp16 or args.bf16:
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    count = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    print(f" > number of parameters on (tensor, pipeline) model parallel rank "
          f"({parallel_state.get_tensor_model_parallel_rank()}, "
          f"{parallel_state.get_pipeline_model_parallel_rank()}): {count}", flush=True)
    if not wrap_with_ddp:
        return chunks
    ddp_config = ddp_config_from_args(args)
    wrapped = [DistributedDataParallel(chunk.config, ddp_config, chunk,
                                       disable_bucketing=index > 0)
               for index, chunk in enumerate(chunks)]
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def step_config(model: list, optimizer, timers: Timers):
    """The model config as ``train_step`` needs it: how gradients are finished, synchronised
    across microbatches and scaled."""
    config = get_model_config(model[0])
    config.timers = timers
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in model]
    if len(model) == 1:
        config.no_sync_func = config.no_sync_func[0]
    if get_args().fp16:
        config.grad_scale_func = optimizer.scale_loss
    return config


def get_optimizer_param_scheduler(optimizer) -> OptimizerParamScheduler:
    """Learning rate and weight decay per sample consumed, as upstream counts steps
    (``lr_schedule``)."""
    return optimizer_param_scheduler_from_args(optimizer, get_args())


def setup_model_and_optimizer(model_provider_func: Callable,
                              model_type=ModelType.encoder_or_decoder):
    model = get_model(model_provider_func, model_type)
    optimizer = get_megatron_optimizer(optimizer_config_from_args(get_args()), model)
    return model, optimizer, get_optimizer_param_scheduler(optimizer)


def build_train_valid_test_data_iterators(provider: Callable, consumed_samples: int,
                                          num_chunks: int):
    """Iterators (one per model chunk with interleaving) over train, validation and test."""
    args = get_args()
    eval_runs = args.train_iters // args.eval_interval + 1 if args.eval_interval else 0
    sizes = [args.train_iters * args.global_batch_size,
             eval_runs * args.eval_iters * args.global_batch_size,
             args.eval_iters * args.global_batch_size]
    train_set, valid_set, test_set = provider(sizes)
    pad_id = _padding_token(get_tokenizer())
    loaders = [build_data_loader(train_set, consumed_samples, args, pad_id=pad_id),
               build_data_loader(valid_set, 0, args, pad_id=pad_id),
               build_data_loader(test_set, 0, args, pad_id=pad_id)]

    # Stages in the middle of the pipeline read no data but must run every evaluation too:
    # every rank learns which splits exist anywhere.
    present = torch.tensor([loader is not None for loader in loaders], dtype=torch.int32,
                           device=_device(args))
    if dist.is_initialized():
        dist.all_reduce(present, op=dist.ReduceOp.MAX)

    def iterators(loader, exists: bool, cyclic: bool):
        if not exists:
            return None
        if loader is None:
            return _NoData(num_chunks)
        make = (lambda: cyclic_iter(loader)) if cyclic else (lambda: iter(loader))
        return [make() for _ in range(num_chunks)] if num_chunks > 1 else make()

    return (iterators(loaders[0], bool(present[0]), False),
            iterators(loaders[1], bool(present[1]), True),
            iterators(loaders[2], bool(present[2]), True))


class _NoData(list):
    """What a stage that reads no data passes to the schedule: one None per model chunk."""

    def __init__(self, num_chunks: int):
        super().__init__([None] * num_chunks)


def _padding_token(tokenizer) -> int:
    """What fills the end of shorter samples (never trained on): pad if the tokenizer has one."""
    try:
        pad = tokenizer.pad
    except NotImplementedError:
        pad = None
    return pad if isinstance(pad, int) and pad >= 0 else tokenizer.eod


def _for_schedule(data_iterator, model):
    if isinstance(data_iterator, _NoData):
        return list(data_iterator) if len(model) > 1 else None
    return data_iterator


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    """One iteration: every microbatch forward and backward, then the optimizer step."""
    args = get_args()
    data_iterator = _for_schedule(data_iterator, model)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = get_forward_backward_func()(
        forward_step_func=forward_step_func, data_iterator=data_iterator,
        model=model if len(model) > 1 else model[0], num_microbatches=num_microbatches(args),
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.seq_length, forward_only=False)
    update_successful, grad_norm, num_zeros = optimizer.step()
    if update_successful:
        opt_param_scheduler.step(increment=args.global_batch_size)
    return _average_reports(losses_reduced), int(not update_successful), grad_norm, num_zeros


def _average_reports(reports: list) -> dict[str, float]:
    """Mean of each reported value over the microbatches (last pipeline stage; {} elsewhere)."""
    if not reports or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    return {key: sum(float(r[key]) for r in reports) / len(reports) for key in reports[0]}


class _LogState:
    def __init__(self):
        self.totals: dict[str, float] = {}
        self.iterations = 0
        self.skipped = 0
        self.nan = 0
        self.started = time.perf_counter()


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
          valid_data_iterator, process_non_loss_data_func, config, iteration: int,
          consumed_samples: int, timers: Timers) -> tuple[int, int]:
    args = get_args()
    for chunk in model:
        chunk.train()
    writer = metrics_writers.get_writer()
    watcher = SigtermWatcher() if args.exit_signal_handler else None
    state = _LogState()
    device = _device(args)
    while iteration < args.train_iters:
        loss_dict, skipped, grad_norm, _ = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config)
        iteration += 1
        consumed_samples += args.global_batch_size
        _accumulate(state, loss_dict, skipped)
        if iteration % args.log_interval == 0:
            training_log(state, iteration, consumed_samples, optimizer, grad_norm, timers, writer)
        if args.eval_interval and iteration % args.eval_interval == 0 and \
                valid_data_iterator is not None and args.eval_iters > 0:
            evaluate_and_print_results("validation", forward_step_func, valid_data_iterator, model,
                                       iteration, process_non_loss_data_func, config, writer)
        saved = False
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            _checkpointing().save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                          consumed_samples)
            saved = True
        stop = watcher is not None and watcher.any_rank_received(device)
        if stop or (args.exit_interval and iteration % args.exit_interval == 0):
            if args.save and not saved:
                _checkpointing().save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
                                              consumed_samples)
            reason = "SIGTERM" if stop else f"--exit-interval {args.exit_interval}"
            print_rank_0(f"exiting at iteration {iteration} ({reason})")
            if writer is not None:
                writer.close()
            _leave_together()
            raise SystemExit(0)
    if writer is not None:
        writer.close()
    return iteration, consumed_samples


def _accumulate(state: _LogState, loss_dict: dict, skipped: int) -> None:
    state.iterations += 1
    state.skipped += skipped
    for key, value in loss_dict.items():
        if math.isnan(value) or math.isinf(value):
            state.nan += 1
        elif not skipped:
            state.totals[key] = state.totals.get(key, 0.0) + value


def training_log(state: _LogState, iteration: int, consumed_samples: int, optimizer,
                 grad_norm, timers: Timers, writer) -> None:
    """Upstream's log line, printed by the last rank."""
    args = get_args()
    elapsed = (time.perf_counter() - state.started) / state.iterations
    learning_rate = optimizer.param_groups[0]["lr"]
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
    line += f" iteration {iteration:8d}/{args.train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {1000 * elapsed:.1f} |"
    if args.log_throughput:
        flops = num_floating_point_operations(args, args.global_batch_size)
        line += f" throughput per GPU (TFLOP/s/GPU): {flops / (elapsed * 1e12 * args.world_size):.1f} |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {args.global_batch_size:5d} |"
    counted = max(1, state.iterations - state.skipped - state.nan)
    for key, total in state.totals.items():
        line += f" {key}: {total / counted:.6E} |"
    line += f" loss scale: {float(optimizer.get_loss_scale()):.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {float(grad_norm):.3f} |"
    line += f" number of skipped iterations: {state.skipped:3d} |"
    line += f" number of nan iterations: {state.nan:3d} |"
    print_rank_last(line)
    if writer is not None:
        writer.add_scalar("learning-rate", learning_rate, iteration)
        writer.add_scalar("iteration-time", elapsed, iteration)
        for key, total in state.totals.items():
            writer.add_scalar(key, total / counted, iteration)
        if grad_norm is not None:
            writer.add_scalar("grad-norm", float(grad_norm), iteration)
    timers.elapsed_ms(["forward-backward"])  # reset per interval
    state.__init__()


def evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config,
             verbose: bool = False) -> dict[str, float]:
    """Mean reported losses over ``--eval-iters`` forward-only iterations."""
    del process_non_loss_data_func, verbose, config
    args = get_args()
    data_iterator = _for_schedule(data_iterator, model)
    for chunk in model:
        chunk.eval()
    totals: dict[str, float] = {}
    with torch.no_grad():
        for _ in range(args.eval_iters):
            reports = get_forward_backward_func()(
                forward_step_func=forward_step_func, data_iterator=data_iterator,
                model=model if len(model) > 1 else model[0],
                num_microbatches=num_microbatches(args), seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                forward_only=True)
            for key, value in _average_reports(reports).items():
                totals[key] = totals.get(key, 0.0) + value / args.eval_iters
    for chunk in model:
        chunk.train()
    return totals


def evaluate_and_print_results(prefix: str, forward_step_func, data_iterator, model,
                               iteration: int, process_non_loss_data_func, config,
                               writer=None) -> None:
    results = evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func,
                       config)
    line = f" {prefix} loss at iteration {iteration} |"
    for key, value in results.items():
        line += f" {key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E} |"
        if writer is not None:
            writer.add_scalar(f"{key} {prefix}", value, iteration)
    print_rank_last("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
