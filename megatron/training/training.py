"""``pretrain()``: start-up, model and optimizer, data, the training loop, evaluation, checkpoints.

Upstream Megatron-LM's entry points and log line; the model, the pipeline schedules, DDP and
the optimizer are megatron.core's. Before any model exists the pipeline layout is proven with
the verifier (``pipeline_parallel.verify``) against a model of the job's transport (gloo or
NCCL): a layout that would cross or deadlock is refused with the verifier's report.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size, get_current_running_global_batch_size, get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import flight_recorder, get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communicator import set_debug_tags
from megatron.core.pipeline_parallel.verify import Layout, VerificationError, verify
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION, RerunDataIterator, RerunMode, RerunState,
    get_rerun_state_machine,
)
from megatron.core.transformer.cuda_graphs import delete_cuda_graphs
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config
from megatron.training import metrics_writers, progress_log, rendezvous, run_clock
from megatron.training.arguments import ArgumentError, validate_training_args
from megatron.training.batch_schedule import resolve_train_iters, train_samples
from megatron.training.checkpoint import pending
from megatron.training.checkpoint_and_exit import (
    checkpoint_and_decide_exit, save_checkpoint_and_time,
)
from megatron.training.config_builders import ddp_config_from_args, optimizer_config_from_args
from megatron.training.data_loading import build_data_loader, cyclic_iter
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.initialize import initialize_megatron
from megatron.training.iteration_log import (
    LogState, format_evaluation_line, step_report, training_log, write_evaluation_scalars,
)
from megatron.training.loop_args import validate_loop_args
from megatron.training.loop_hooks import LoopHooks
from megatron.training.lr_schedule import optimizer_param_scheduler_from_args
from megatron.training.memory import empty_unused_memory, start_memory_history
from megatron.training.param_checks import WeightHashMismatch
from megatron.training.rendezvous import StartupError
from megatron.training.run_clock import print_datetime
from megatron.training.signals import SigtermWatcher
from megatron.training.timers import Timers, get_timers, set_timers
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
        except WeightHashMismatch as error:
            # Raised on every rank at the same iteration; one of them says which ranks.
            if error.reporter:
                print(f"error: {error}", file=sys.stderr, flush=True)
            _leave_together()
            raise SystemExit(1) from None
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
        # A provider may check its inputs here, before the model is built and a checkpoint
        # loaded (pretrain_gpt.py: that the data's files exist), raising ArgumentError.
        preflight = getattr(train_valid_test_dataset_provider, "preflight", None)
        if preflight is not None:
            rendezvous.check_on_every_rank(lambda: preflight(args), (ArgumentError,),
                                           args.distributed_startup_timeout_seconds)
        validate_loop_args(args)
        resolve_train_iters(args)
        preflight_pipeline_check(args, get_num_microbatches())
    except (ArgumentError, StartupError, VerificationError) as error:
        # Bad input is the user's to fix: say so in one line, without a traceback.
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    _start_p2p_diagnostics(args)
    run_clock.agree_on_start_time()
    print_rank_0(f"time to initialize megatron (seconds): "
                 f"{time.time() - run_clock.start_time():.3f}")
    print_datetime("after megatron is initialized")
    if args.log_progress:
        progress_log.job_started(args)
    metrics_writers.start(args)  # a missing optional package warns here, not at iteration 1
    timers = Timers(args.timing_log_level, args.timing_log_option)
    set_timers(timers)
    start_memory_history(args)

    timers("model-and-optimizer-setup", log_level=0).start(barrier=True)
    model, optimizer, scheduler = setup_model_and_optimizer(model_provider, model_type)
    config = step_config(model, optimizer, timers)
    iteration, consumed = 0, 0
    if args.load or args.pretrained_checkpoint:
        iteration, consumed = _checkpointing().load_checkpoint(model, optimizer, scheduler)
    progress_log.job_resumed_from(consumed)
    timers("model-and-optimizer-setup").stop()
    print_datetime("after model, optimizer, and learning rate scheduler are built")

    timers("train/valid/test-data-iterators-setup", log_level=0).start(barrier=True)
    train_iterator, valid_iterator, test_iterator = build_train_valid_test_data_iterators(
        train_valid_test_dataset_provider, consumed, len(model))
    timers("train/valid/test-data-iterators-setup").stop()
    print_datetime("after dataloaders are built")
    print_rank_0("done with setup ...")
    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"],
               barrier=True)

    if not args.skip_train:
        print_rank_0("training ...")
        print_rank_0(f"> starting training at iteration {iteration} ({consumed} samples consumed)")
        iteration, consumed = train(forward_step_func, model, optimizer, scheduler,
                                    train_iterator, valid_iterator, process_non_loss_data_func,
                                    config, iteration, consumed)
        print_datetime("after training is done")
        if args.save and iteration and \
                (args.save_interval is None or iteration % args.save_interval):
            save_checkpoint_and_time(iteration, model, optimizer, scheduler, consumed)
    else:
        print_rank_0("skipping training (--skip-train is on) ...")
    for split, data_iterator in (("validation", valid_iterator), ("test", test_iterator)):
        if data_iterator is not None and args.eval_iters > 0:
            evaluate_and_print_results(f"iteration {iteration} on {split} set",
                                       forward_step_func, data_iterator, model, iteration,
                                       process_non_loss_data_func, config, verbose=True,
                                       write_to_tensorboard=not args.skip_train,
                                       consumed_samples=consumed)
    metrics_writers.finish()
    _leave_together()


def _leave_together() -> None:
    """End every rank's process groups once all ranks are done: a rank whose connections close
    while a peer's transport threads still read from them can abort that peer at exit."""
    pending.wait_for_pending()  # an --async-save checkpoint still being written
    if not dist.is_initialized():
        return
    delete_cuda_graphs()  # graphs holding NCCL collectives would stall their communicators' end
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


_VERIFIED_MICROBATCH_COUNTS: set[int] = set()


def preflight_pipeline_check(args, num_microbatches: int) -> None:
    """Refuse a pipeline layout that would cross tensors or deadlock on the job's transport,
    before running it: every rank's schedule, as the executor runs it, against a model of gloo
    or NCCL (a second or two at start-up for the largest layouts). A batch-size ramp-up checks
    each new microbatch count when the ramp reaches it (the same on every rank)."""
    if args.pipeline_model_parallel_size == 1 or num_microbatches in _VERIFIED_MICROBATCH_COUNTS:
        return
    mode = ("overlapped" if args.overlap_p2p_comm else
            "batched" if args.batch_p2p_comm else "unbatched")
    verify(Layout(args.pipeline_model_parallel_size,
                  args.virtual_pipeline_model_parallel_size or 1, num_microbatches,
                  args.variable_seq_lengths, mode, args.microbatch_group_size_per_vp_stage),
           transport=args.distributed_backend)
    _VERIFIED_MICROBATCH_COUNTS.add(num_microbatches)


def _start_p2p_diagnostics(args) -> None:
    set_debug_tags(args.p2p_debug_tags)
    if args.pipeline_model_parallel_size > 1:
        timeout = args.p2p_timeout_seconds or 60.0 * args.distributed_timeout_minutes
        dump_dir = args.p2p_dump_dir or os.path.join(args.save or ".", "p2p_hang")
        flight_recorder.start_watchdog(timeout, dump_dir)


def eval_num_microbatches(args) -> int:
    """Evaluation runs whole batches of --eval-global-batch-size (default: the final global
    batch size, as upstream's), whatever the ramp-up."""
    return args.eval_global_batch_size // (args.micro_batch_size * args.data_parallel_size)


def _device(args) -> torch.device:
    if args.distributed_backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _precision_of_args(config, args):
    """``config`` with ``--fp16``/``--bf16`` as the arguments say: the precision the model is
    wrapped in follows the arguments, as upstream's, also when a model provider built its
    config without them (the copy is the wrapper's; the model keeps its own)."""
    if (config.fp16, config.bf16) == (bool(args.fp16), bool(args.bf16)):
        return config
    return dataclasses.replace(config, fp16=bool(args.fp16), bf16=bool(args.bf16))


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
        chunks = [Float16Module(_precision_of_args(chunk.config, args), chunk)
                  for chunk in chunks]
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
    optimizer.config.timers = timers
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in model]
    if len(model) == 1:
        config.no_sync_func = config.no_sync_func[0]
    if get_args().overlap_param_gather and get_args().align_param_gather:
        # Before a chunk's first forward, launch its all-gathers and the next chunk's, which
        # then arrive while this one computes (upstream's interleaved schedule does the same).
        config.param_sync_func = [_start_param_sync_of(model[index:index + 2])
                                  for index in range(len(model))]
    if get_args().fp16:
        config.grad_scale_func = optimizer.scale_loss
    return config


def _start_param_sync_of(chunks: list) -> Callable:
    def start(parameters=None) -> None:
        for chunk in chunks:
            chunk.start_param_sync()
    return start


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
    sizes = [train_samples(args),
             eval_runs * args.eval_iters * args.eval_global_batch_size,
             args.eval_iters * args.eval_global_batch_size]
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
        # Training reads through RerunDataIterator, which can serve an iteration again.
        make = ((lambda: cyclic_iter(loader)) if cyclic
                else (lambda: RerunDataIterator(iter(loader))))
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
    """One iteration: every microbatch forward and backward (again, as often as the rerun
    state machine asks), then the optimizer step. Returns upstream's ``(losses, skipped,
    should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad)``; when the
    machine stops the job the optimizer does not step."""
    args = get_args()
    timers = get_timers()
    data_iterator = _for_schedule(data_iterator, model)
    machine = get_rerun_state_machine()
    while machine.should_run_forward_backward(data_iterator):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = get_forward_backward_func()(
            forward_step_func=forward_step_func, data_iterator=data_iterator,
            model=model if len(model) > 1 else model[0], num_microbatches=get_num_microbatches(),
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.seq_length, forward_only=False)
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if should_exit:
        return {}, 1, should_checkpoint, should_exit, exit_code, None, None
    empty_unused_memory(args, level=1)
    timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    optimizer.statistics_on_device = True  # the gradient norm is read where it is logged
    update_successful, grad_norm, num_zeros = optimizer.step()
    timers("optimizer").stop()
    if update_successful:
        opt_param_scheduler.step(increment=get_current_running_global_batch_size())
    empty_unused_memory(args, level=2)
    return (_average_reports(losses_reduced), int(not update_successful), False, False, 0,
            grad_norm, num_zeros)


def _average_reports(reports: list) -> dict[str, torch.Tensor]:
    """Each reported value over the microbatches (last pipeline stage; {} elsewhere): a
    ``(sum, count)`` pair is summed over microbatches and data- and context-parallel ranks,
    then divided, as upstream does; a plain value is averaged over the microbatches. The
    averages stay on the device: read on the host only when a log line or writer needs them,
    so an iteration does not wait for its optimizer step before the next one is queued."""
    if not reports or not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    averaged = {}
    for key in reports[0]:
        values = [torch.as_tensor(report[key]).detach().float().view(-1) for report in reports]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0)
            if dist.is_initialized():
                dist.all_reduce(total, group=parallel_state.get_data_parallel_group(
                    with_context_parallel=True))
            averaged[key] = total[0] / total[1].clamp(min=1.0)
        else:
            averaged[key] = torch.cat(values).mean()
    return averaged


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
          valid_data_iterator, process_non_loss_data_func, config, iteration: int,
          consumed_samples: int) -> tuple[int, int]:
    args = get_args()
    timers = get_timers()  # the log line reads the same ones
    for chunk in model:
        chunk.train()
    metrics_writers.write_args(args, iteration)
    watcher = SigtermWatcher() if args.exit_signal_handler else None
    state = LogState()
    hooks = LoopHooks(args, model)
    hooks.start(iteration)
    # The log line divides this timer by the iterations of this call's LogState: time an
    # earlier call left on it unlogged (the benchmark's warm-up steps) is not theirs.
    timers("interval-time", log_level=0).reset()
    timers("interval-time", log_level=0).start(barrier=True)
    print_datetime("before the start of training step")
    should_exit, exit_code = False, 0
    machine = get_rerun_state_machine()
    if machine.state == RerunState.NOT_RUNNING_YET:  # else resumed for a re-run: its own count
        machine.current_iteration = iteration - 1  # its messages number iterations as the log
    update_num_microbatches(consumed_samples, consistency_check=False)
    num_microbatches = get_num_microbatches()
    while iteration < args.train_iters:
        hooks.before_step(iteration)
        update_num_microbatches(consumed_samples, verbose=True)
        if get_num_microbatches() != num_microbatches:
            # As upstream: a batch-size ramp step is a checkpoint (its state is in the file).
            if args.save:
                save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler,
                                         consumed_samples)
            num_microbatches = get_num_microbatches()
            preflight_pipeline_check(args, num_microbatches)
        loss_dict, skipped, should_checkpoint, rerun_exit, exit_code, grad_norm, num_zeros = \
            train_step(forward_step_func, train_data_iterator, model, optimizer,
                       opt_param_scheduler, config)
        if rerun_exit:
            if should_checkpoint:
                exit_code = _save_for_the_rerun(exit_code, iteration, model, optimizer,
                                                opt_param_scheduler, consumed_samples)
            should_exit = True
            break
        iteration += 1
        batch_size = get_current_running_global_batch_size()
        consumed_samples += batch_size
        # Samples a batch rounded down by --decrease-batch-size-if-needed left out.
        state.skipped_samples += get_current_global_batch_size() - batch_size
        training_log(state, step_report(model, optimizer, loss_dict, skipped, grad_norm,
                                        num_zeros), iteration, consumed_samples, batch_size)
        if args.eval_interval and iteration % args.eval_interval == 0 and \
                valid_data_iterator is not None and args.eval_iters > 0:
            timers("interval-time").stop()
            with hooks.around_evaluation():
                evaluate_and_print_results(f"iteration {iteration}", forward_step_func,
                                           valid_data_iterator, model, iteration,
                                           process_non_loss_data_func, config,
                                           consumed_samples=consumed_samples)
            timers("interval-time", log_level=0).start(barrier=True)
        hooks.after_step(iteration)
        should_exit = checkpoint_and_decide_exit(iteration, model, optimizer,
                                                 opt_param_scheduler, consumed_samples, watcher)
        if should_exit:
            break
    timers("interval-time").stop()  # a later call starts it afresh (a running timer ignores start)
    hooks.finish()
    writer = metrics_writers.get_writer()
    if writer is not None:
        writer.flush()
    if should_exit:
        metrics_writers.finish()
        _leave_together()
        raise SystemExit(exit_code)
    return iteration, consumed_samples


def _save_for_the_rerun(exit_code: int, iteration: int, model, optimizer, opt_param_scheduler,
                        consumed_samples: int) -> int:
    """Save the iteration's starting state, as the rerun state machine asks for a reproduced
    fault (to be re-run on another device from it); returns the job's exit code, which says
    there is no diagnosis to come where there is no --save."""
    args = get_args()
    if not args.save:
        print_rank_0("rerun state machine: the rejected result reproduced, but without --save "
                     "there is no checkpoint to re-run the iteration from on another GPU; "
                     "stopping without a diagnosis")
        return EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler, consumed_samples)
    print_rank_0(f"rerun state machine: saved iteration {iteration} to {args.save}; resume with "
                 f"--load {args.save} on other GPUs (exit code {exit_code})")
    return exit_code


def evaluate(forward_step_func, data_iterator, model, process_non_loss_data_func, config,
             verbose: bool = False, non_loss_data_func=None):
    """Mean reported losses over ``--eval-iters`` forward-only iterations, as
    ``(losses, None, timelimit)``: ``timelimit`` is True, and the losses None, when
    ``--exit-duration-in-mins`` ran out during the evaluation."""
    del process_non_loss_data_func, non_loss_data_func
    args = get_args()
    timers = get_timers()
    timers("evaluate", log_level=0).start(barrier=True)
    data_iterator = _for_schedule(data_iterator, model)
    for chunk in model:
        chunk.eval()
    totals: dict[str, float] = {}
    if verbose:
        print_rank_0(f"Evaluating on {args.eval_iters * args.eval_global_batch_size} samples")
    timed_config, config.timers = config.timers, None  # evaluation is not training time
    machine = get_rerun_state_machine()
    rerun_mode = machine.get_mode()
    machine.set_mode(RerunMode.DISABLED)  # evaluation results are checked, never re-run
    try:
        with torch.no_grad():
            for step in range(1, args.eval_iters + 1):
                if verbose:
                    print_rank_0(f"Evaluating iter {step}/{args.eval_iters}")
                reports = get_forward_backward_func()(
                    forward_step_func=forward_step_func, data_iterator=data_iterator,
                    model=model if len(model) > 1 else model[0],
                    num_microbatches=eval_num_microbatches(args), seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
                    forward_only=True)
                empty_unused_memory(args, level=1)
                for key, value in _average_reports(reports).items():
                    totals[key] = totals.get(key, 0.0) + value / args.eval_iters
                if args.exit_duration_in_mins and \
                        run_clock.duration_exceeded(args.exit_duration_in_mins)[0]:
                    print_rank_0("Exiting during evaluation, timelimit reached")
                    return None, None, True
    finally:
        machine.set_mode(rerun_mode)
        config.timers = timed_config
        for chunk in model:
            chunk.train()
        timers("evaluate").stop()
    timers.log(["evaluate"])
    return {key: float(total) for key, total in totals.items()}, None, False


def evaluate_and_print_results(prefix: str, forward_step_func, data_iterator, model,
                               iteration: int, process_non_loss_data_func, config,
                               verbose: bool = False, write_to_tensorboard: bool = True,
                               non_loss_data_func=None,
                               consumed_samples: Optional[int] = None) -> None:
    """Evaluate and print upstream's ``validation loss at <prefix> | ...`` line between two
    rules (last rank); the results also go to the metrics writer unless told not to."""
    args = get_args()
    results, _, timelimit = evaluate(forward_step_func, data_iterator, model,
                                     process_non_loss_data_func, config, verbose,
                                     non_loss_data_func)
    if timelimit:
        return
    writer = metrics_writers.get_writer() if write_to_tensorboard else None
    if writer is not None:
        write_evaluation_scalars(args, writer, results, iteration, consumed_samples)
    line = format_evaluation_line(prefix, results)
    rule = "-" * (len(line) + 1)
    print_rank_last(f"{rule}\n{line}\n{rule}")
