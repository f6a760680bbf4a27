"""The rerun state machine (``--rerun-mode``): tell a faulty GPU from a real numerical problem.

Training code asks the machine whether to run an iteration's forward and backward passes
(``should_run_forward_backward``, a loop) and hands it results to check (``validate_result``:
a NaN loss, a NaN gradient norm, a spiky loss). What happens to a rejected result depends on
the mode:

``disabled``
    The result is checked once; a rejected fatal result raises ``RuntimeError`` naming the
    rank, the iteration and the check, a non-fatal one is logged. Within the iteration loop a
    check whose verdict is a tensor (``torch.isnan`` of a loss on the GPU) is judged with the
    iteration's others in one read (``rerun.deferred_checks``): a read per check emptied the
    GPU's queue each time (once per microbatch). They are settled at the end of a
    forward-backward schedule, at the data-parallel gradient NaN check and in
    ``should_run_forward_backward``: judged there until an optimizer step has judged them
    around its update (``judge_deferred_results_at_update``, which every step of this tree's
    optimizers calls), staged only from then on. The step reads them before its update, or,
    where the update takes a device flag (torch's fused Adam), hands it the fatal verdicts and
    reads them after the update is queued: a rejected update leaves parameters and state
    unchanged and the check raises in the same iteration. Outside the loop a check is judged
    at once.
``validate_results``
    The whole iteration runs again on the same device with the same data and random states.
    A different result there is a transient fault (exit code 17, or training goes on for a
    non-fatal check). The same result again is saved as a checkpoint and the job exits with
    code 16: resumed from it on another device, the iteration runs a third time. A different
    result there means the first device computes wrongly (persistent fault, exit 17); the same
    result means the input gives it (a correct result, exit 17 for a fatal check, else training
    goes on). Resumed on the same device the job exits with 16 again.
``report_stats`` (``RerunMode.REPORT_DETERMINISM_STATS``)
    Every iteration runs twice and the relative difference of each checked result between the
    runs is logged from rank 0 every ``REPORTING_INTERVAL_ITERATIONS`` iterations.

The state is checkpointed in megatron-core 0.11's layout (a pickled dict; its enums and call
records pickle under upstream's module path, so either tree reads the other's). Upstream
saves one copy per (pipeline, tensor) rank, written by the first data-parallel replica, which
loses what other replicas found; before such a checkpoint this machine gathers every rank's
failure into each copy (``failures_by_rank``), so the rank that failed re-checks its own
result after a resume. Data need not be replayed from the checkpoint: the resumed sampler
reads the iteration's samples again from the saved ``consumed_samples``.

The first iteration of a process is not validated (a checkpoint needs a stepped optimizer);
a rejected fatal result there raises as in ``disabled`` rather than training on it.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import random
import socket
import sys
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, NamedTuple, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

# Upstream's module defines these two: code imports them from here.
from megatron.core.rerun.data_iterator import RerunDataIterator
from megatron.core.rerun.deferred_checks import DeferredChecks
from megatron.core.rerun.quick_stats import QuickStats  # noqa: F401

logger = logging.getLogger(__name__)

# The job's exit codes: resume from the checkpoint just saved (on another device) to finish
# the diagnosis; a result failed validation and the diagnosis is done.
EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = 17

COMPARISON_MATCH: float = 0.0
COMPARISON_MISMATCH: float = math.inf

DataIteratorArgType = Optional[Union[RerunDataIterator, list]]


class Caller(NamedTuple):
    """Where a validation was asked for: the calling file and line, and the global rank."""

    filename: str
    lineno: int
    rank: int


class Call(NamedTuple):
    """One validation: its caller and how many times that caller validated this iteration."""

    caller: Caller
    sequence: int


class RerunDiagnostic(str, Enum):
    """What a re-run found: the result was right, or the fault did or did not reproduce."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"

    @classmethod
    def from_flag(cls, value: str) -> "RerunMode":
        """``--rerun-mode``'s value (``report_stats`` is the flag's name for the stats mode)."""
        return cls.REPORT_DETERMINISM_STATS if value == "report_stats" else cls(value)


class RerunState(Enum):
    """Where the machine is in an iteration; the values are upstream's (they are pickled)."""

    NOT_RUNNING_YET = 0  # between iterations
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2  # a result was rejected; the same device runs the iteration again
    WILL_RERUN_FROM_CHECKPOINT = 3  # reproduced: saved, to be resumed on another device
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5  # resumed on the suspect device: resume again


# What a line of the rejected-result tracker file records: a rejection while disabled, in an
# initial run, and the verdicts of each re-run (later upstream's names, each value its name in
# lower case).
RerunValidationStatus = Enum("RerunValidationStatus", {
    status.upper(): status for status in (
        "rerun_disabled", "initial_run",
        *(f"{which}_rerun_{verdict}" for which in ("first", "second")
          for verdict in ("not_reproducible", "reproducible")))},
    type=str, module=__name__, qualname="RerunValidationStatus")


# The saved fields besides the mode, the state, the iteration, the injector and the data.
_PER_RANK_FIELDS = ("rerun_requested", "checkpoint_requested", "restart_again_requested",
                    "continue_requested", "failed_validation_call", "initial_result",
                    "suspicious_node", "suspicious_device", "last_loss")

# What each rank concluded at the end of a re-run, reduced over all ranks by maximum: a
# higher verdict wins (saving for a diagnosis beats stopping, stopping beats going on).
_NOTHING, _CONTINUE, _STOP, _CHECKPOINT = range(4)


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _log_rank0(level: int, message: str) -> None:
    if _rank() == 0:
        logger.log(level, message)


def _this_device() -> tuple[str, int]:
    """(node, device index) this rank computes on; the index is -1 on a CPU."""
    return socket.gethostname(), (torch.cuda.current_device() if torch.cuda.is_available()
                                  else -1)


def _as_float(result: Any) -> float:
    return float(result.item() if torch.is_tensor(result) else result)


def _compare_floats(a: Any, b: Any) -> float:
    """Relative difference of two scalars: 0 when equal (NaN equals NaN), infinite when one is
    NaN or infinite and the other is not."""
    x, y = _as_float(a), _as_float(b)
    if x == y or (math.isnan(x) and math.isnan(y)):
        return COMPARISON_MATCH
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return COMPARISON_MISMATCH
    return math.fabs(2 * (x - y) / (x + y)) if x + y != 0 else COMPARISON_MISMATCH


def _same_call(a: Optional[Call], b: Optional[Call]) -> bool:
    """The same validation, also when the job was resumed from another install path."""
    if a is None or b is None:
        return False
    return (os.path.basename(a.caller.filename), a.caller.lineno, a.caller.rank, a.sequence) == \
        (os.path.basename(b.caller.filename), b.caller.lineno, b.caller.rank, b.sequence)


class RerunStateMachine:
    """See the module docstring. ``state_save_func`` / ``state_restore_func`` save and restore
    what else an iteration changes before the optimizer step (the random generators of
    Python, NumPy and torch are handled here)."""

    REPORTING_INTERVAL_ITERATIONS: int = 2

    def __init__(self, state_save_func: Optional[Callable[[], Any]] = None,
                 state_restore_func: Optional[Callable[[Any], None]] = None,
                 mode: RerunMode = RerunMode.DISABLED,
                 error_injector: Optional["RerunErrorInjector"] = None,
                 result_rejected_tracker_filename: Optional[str] = None) -> None:
        self.mode = RerunMode(mode)
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        if result_rejected_tracker_filename is not None:
            with open(result_rejected_tracker_filename, "a"):  # fail now, not at a fault
                pass
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1  # 0-based; messages show it 1-based
        self.first_iteration_complete = False
        # This rank's requests, reduced over all ranks at the end of each run.
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.stop_requested = False
        self.logged_sdc_enabled = False
        self.error_injector = error_injector or RerunErrorInjector()
        self.validation_counts: dict[Caller, int] = defaultdict(int)
        self.failed_validation_call: Optional[Call] = None
        self.initial_result: Any = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[int] = None
        self.failures_by_rank: Optional[list[Optional[dict[str, Any]]]] = None  # by rank
        self.data_iterator_checkpoints: Optional[list] = None
        self.saved_state: Optional[dict[str, Any]] = None
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self.last_loss: Optional[float] = None
        self.large_value_counts: dict[str, int] = {}
        self.max_values: dict[str, float] = {}
        self.saved_results: dict[Call, Any] = {}
        self.stats: dict[Caller, QuickStats] = defaultdict(QuickStats)
        self._deferred = DeferredChecks()
        # Set by an optimizer step that judges the deferred checks around its update (see
        # ``judge_deferred_results_at_update``): from then on the earlier points only stage them.
        self.deferred_results_judged_at_update = False
        # Upstream's line; a warning only where the machine does more than check once.
        _log_rank0(logging.INFO if self.mode == RerunMode.DISABLED else logging.WARNING,
                   f"RerunStateMachine initialized in mode {self.mode}")

    def set_mode(self, mode: RerunMode) -> None:
        self.mode = RerunMode(mode)

    def get_mode(self) -> RerunMode:
        return self.mode

    # -- the iteration loop -------------------------------------------------------------------

    def should_run_forward_backward(self, data_iterator: DataIteratorArgType) -> bool:
        """Whether to run the iteration's forward and backward passes (again): the condition
        of a ``while`` loop around them, with the iteration's data iterator(s)."""
        self.settle_deferred_results()
        self.validation_counts = defaultdict(int)
        iterators = self._rerun_iterators(data_iterator)
        if self.state == RerunState.NOT_RUNNING_YET:
            self.current_iteration += 1
            self.state = RerunState.INITIAL_RUN
            for iterator in iterators:
                iterator.advance(keep=self.mode != RerunMode.DISABLED)
            if self.mode != RerunMode.DISABLED:
                self._save_state()
                self.rerun_requested = self.checkpoint_requested = False
                self.restart_again_requested = self.continue_requested = False
                self.stop_requested = False
            return True
        if self.state == RerunState.INITIAL_RUN:
            if self.mode == RerunMode.DISABLED or not self._any_rank(self.rerun_requested):
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if self.mode == RerunMode.VALIDATE_RESULTS:
                _log_rank0(logging.WARNING,
                           "Need to rerun step to check reproducibility of initial result")
            self.state = RerunState.RERUNNING_IN_PLACE
            self._restore_state()
            self._rewind(iterators)
            return True
        if self.state == RerunState.RERUNNING_IN_PLACE:
            if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
                self.state = RerunState.NOT_RUNNING_YET
                self._maybe_report_stats()
                self.saved_results = {}
                return False
            verdict = self._verdict()
            if verdict == _CHECKPOINT:
                self._share_failures()
                self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
                # The checkpoint about to be written must hold the iteration's starting state.
                self._restore_state()
                self._rewind(iterators)
            elif verdict == _CONTINUE:
                _log_rank0(logging.WARNING,
                           "Continuing normal execution because failed validation was not fatal")
                self.state = RerunState.NOT_RUNNING_YET
            elif verdict == _NOTHING:
                _log_rank0(logging.ERROR, "The validation that failed was not reached when the "
                           "iteration ran again: the iteration's control flow is not "
                           "deterministic, so no diagnosis can be made")
            return False
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            # The requests that led here were saved (one rank's copy for several ranks).
            self.checkpoint_requested = self.continue_requested = False
            self.restart_again_requested = self.stop_requested = False
            self.state = RerunState.RERUNNING_FROM_CHECKPOINT
            return True
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            verdict = self._verdict()
            if verdict == _CHECKPOINT:  # restart_again: resumed on the suspect device
                _log_rank0(logging.WARNING, "Need to restart job from the same checkpoint "
                           "because it was scheduled on the same node/GPU")
                self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            elif verdict == _CONTINUE:
                _log_rank0(logging.WARNING,
                           "Continuing normal execution because failed validation was not fatal")
                self.state = RerunState.NOT_RUNNING_YET
                self.failures_by_rank = None
            elif verdict == _NOTHING:
                _log_rank0(logging.ERROR, "The validation that failed before the checkpoint was "
                           "not reached when the iteration ran again after the resume: was the "
                           "job resumed with other flags or code?")
            return False
        raise RuntimeError(f"should_run_forward_backward called in state {self.state.name}: a "
                           f"job resumed to re-run an iteration exits after it")

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """After the loop: (save a checkpoint now, stop the job, its exit code)."""
        self.first_iteration_complete = True
        if self.mode != RerunMode.VALIDATE_RESULTS:
            return False, False, 0
        if self.state == RerunState.RERUNNING_IN_PLACE:
            _log_rank0(logging.WARNING,
                       "Exiting now. The job can be resumed from a previous checkpoint")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            _log_rank0(logging.WARNING, "Saving a checkpoint and exiting now. Please resume the "
                       "job from the checkpoint to rerun the last iteration and establish a "
                       "diagnostic")
            return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            _log_rank0(logging.WARNING, "Exiting now. A checkpoint at the last iteration "
                       "already exists if further examination is needed")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            _log_rank0(logging.WARNING, "Exiting now. Please resume the job from the same "
                       "checkpoint to rerun the last iteration and establish a diagnostic")
            return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        return False, False, 0

    # -- results ------------------------------------------------------------------------------

    def validate_result(self, result: Any, rejection_func: Callable[[Any], bool],
                        message: str = "unexpected result",
                        comparison_func: Optional[Callable[[Any, Any], float]] = None,
                        tolerance: float = 0.0, fatal: bool = True) -> None:
        """Check ``result`` (``rejection_func`` True rejects it) during the iteration loop.
        ``comparison_func(initial, rerun)`` gives the relative difference of two results (for
        0-dim tensors by default); within ``tolerance`` they count as the same. ``fatal``:
        whether a rejected result stops the job once diagnosed."""
        if self.mode == RerunMode.DISABLED or (
                self.mode == RerunMode.VALIDATE_RESULTS and self.state == RerunState.INITIAL_RUN
                and not self.first_iteration_complete):
            self._check_once(result, rejection_func, message, fatal)
            return
        if self.state == RerunState.NOT_RUNNING_YET:
            raise RuntimeError("validate_result called outside the should_run_forward_backward "
                               "loop")
        compare = comparison_func or _compare_floats
        call = self._call_of_caller()
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            if self.state == RerunState.INITIAL_RUN:
                self.rerun_requested = True
                self.saved_results[call] = _detached(result)
            elif self.state == RerunState.RERUNNING_IN_PLACE:
                if call not in self.saved_results:
                    raise RuntimeError(f"{message}: no result of the first run to compare with "
                                       f"(the iteration's control flow changed)")
                where = Caller(call.caller.filename, call.caller.lineno, 0)
                self.stats[where].record(compare(self.saved_results[call], result))
            return
        if not self.logged_sdc_enabled:
            self.logged_sdc_enabled = True
            _log_rank0(logging.WARNING, "Result validation enabled")
        if self.state == RerunState.INITIAL_RUN:
            if not self.rerun_requested and (self.error_injector.maybe_inject()
                                             or rejection_func(result)):
                self._record_failure(call, result, message)
        elif self.state in (RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT) \
                and _same_call(call, self.failed_validation_call):
            comparison = self.error_injector.maybe_miscompare(compare, self.initial_result,
                                                              result, self.state)
            if self.state == RerunState.RERUNNING_IN_PLACE:
                self._judge_first_rerun(result, comparison > tolerance, message, fatal)
            else:
                self._judge_second_rerun(result, comparison > tolerance, message, fatal)

    def _track(self, status: RerunValidationStatus, result: Any, message: str) -> None:
        """A line in ``result_rejected_tracker_filename`` (later upstream's format), where set:
        one file many jobs append to tells which nodes keep failing."""
        if self.result_rejected_tracker_filename is None:
            return
        node, device = _this_device()
        line = (f"ts={datetime.datetime.now()} node={node} device={device} "
                f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={_rank()} "
                f"iteration={self.current_iteration + 1} status={status.value} "
                f"result={_as_float(result)} message='{message}'\n")
        try:
            with open(self.result_rejected_tracker_filename, "a") as tracker:
                tracker.write(line)
        except OSError as error:  # the diagnosis goes on without the record
            logger.error(f"could not append to {self.result_rejected_tracker_filename}: {error}")

    def check_deferred_results(self) -> None:
        """Judge the checks deferred so far, in the order they were made, with one read of
        their verdicts (see the module's ``disabled``)."""
        for check in self._deferred.take():
            self._report_rejection(check.result, check.message, check.fatal)

    def settle_deferred_results(self) -> None:
        """Where the deferred checks must be settled before going on (the end of a schedule,
        before a data-parallel reduction, between runs of an iteration): judged now, or only
        staged (their verdicts' copy to the host started) once an optimizer step judges them
        around its update."""
        if self.deferred_results_judged_at_update:
            self._deferred.stage()
        else:
            self.check_deferred_results()

    def judge_deferred_results_at_update(self, update: Callable[[Optional[torch.Tensor]], bool],
                                         skips_on_device: bool) -> bool:
        """Run an optimizer's ``update`` with the deferred checks judged around it: before it,
        or, where it ``skips_on_device`` (it takes a ``found_inf`` flag: torch's fused Adam
        leaves parameters and state unchanged where the flag is 1), after it is queued, the
        flag set where a fatal check rejected its result. There the host waits for the
        verdicts' copy only, while the device runs the update. A rejected fatal check raises
        either way, before the update could take effect. Returns ``update``'s result."""
        self.deferred_results_judged_at_update = True
        flag = self._deferred.rejection() if skips_on_device else None
        if flag is None:
            self.check_deferred_results()
        result = update(flag)
        self.check_deferred_results()
        return result

    def _check_once(self, result: Any, rejection_func, message: str, fatal: bool) -> None:
        rejected = rejection_func(result)
        if isinstance(rejected, torch.Tensor) and self.state == RerunState.INITIAL_RUN:
            self._deferred.add(rejected, result, message, fatal)
        elif rejected:
            self._report_rejection(result, message, fatal)

    def _report_rejection(self, result: Any, message: str, fatal: bool) -> None:
        self._track(RerunValidationStatus.RERUN_DISABLED, result, message)
        node, device = _this_device()
        text = (f"Rank {_rank()}, node {node}, device {device}, iteration "
                f"{self.current_iteration + 1}: Unexpected result {_as_float(result)} "
                f"(message='{message}')")
        if fatal:
            raise RuntimeError(text)
        logger.warning(text)

    def _record_failure(self, call: Call, result: Any, message: str) -> None:
        self.failed_validation_call = call
        self.initial_result = _detached(result)
        self.rerun_requested = True
        self._track(RerunValidationStatus.INITIAL_RUN, result, message)
        logger.error(f"Unexpected result {_as_float(result)} on rank {_rank()} at iteration "
                     f"#{self.current_iteration + 1} invocation #{call.sequence} "
                     f"(message='{message}')")

    def _log_failure(self, text: str, fatal: bool) -> None:
        node, device = _this_device()
        logger.log(logging.ERROR if fatal else logging.WARNING,
                   f"Rank {_rank()}, node {node}, device {device}, iteration "
                   f"#{self.current_iteration + 1}: {text}!")

    def _judge_first_rerun(self, result: Any, differs: bool, message: str, fatal: bool) -> None:
        first, again = _as_float(self.initial_result), _as_float(result)
        self._track(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE if differs
                    else RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, result, message)
        if differs:
            logger.warning(f"First rerun: unexpected result is not reproducible within the "
                           f"tolerance ({again} != {first})")
            self._log_failure("Possible transient error!", fatal)
            self.stop_requested, self.continue_requested = fatal, not fatal
            return
        self.suspicious_node, self.suspicious_device = _this_device()
        self.checkpoint_requested, self.continue_requested = fatal, not fatal
        logger.warning(f"First rerun: unexpected result is reproducible within the tolerance "
                       f"({again} = {first}). Need to rerun on a different GPU to verify "
                       f"correctness")

    def _judge_second_rerun(self, result: Any, differs: bool, message: str, fatal: bool) -> None:
        first, again = _as_float(self.initial_result), _as_float(result)
        if _this_device() == (self.suspicious_node, self.suspicious_device):
            logger.error(f"Got rescheduled on the same GPU. Need to resume again from the same "
                         f"checkpoint (node: {self.suspicious_node}, gpu: "
                         f"{self.suspicious_device})")
            self.restart_again_requested = True
            return
        self._track(RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE if differs
                    else RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, result, message)
        if differs:
            logger.warning(f"Second rerun: unexpected result is not reproducible on a different "
                           f"GPU, therefore was likely incorrect ({again} != {first})")
            self._log_failure("Possible persistent error!", True)
        else:
            logger.warning(f"Second rerun: unexpected result is reproducible on a different GPU, "
                           f"therefore it was likely correct ({again} = {first})")
            self._log_failure(f"Correct result (but possible Application error) ({message})",
                              True)
        self.stop_requested, self.continue_requested = fatal, not fatal

    def is_spiky_loss(self, loss_tensor: torch.Tensor, threshold: float) -> bool:
        """megatron-core 0.11's rejection rule: the loss moved by ``threshold`` (a fraction)
        or more from the previous one; NaN never counts, infinity always."""
        loss, last = _as_float(loss_tensor), self.last_loss
        self.last_loss = loss
        if last is None or math.isnan(loss) or math.isnan(last):
            return False
        if math.isinf(loss) or math.isinf(last):
            return True
        return math.fabs(loss - last) / last >= threshold

    def is_unexpectedly_large(self, result: torch.Tensor, threshold: float, context: str,
                              num_samples: int = 100, resample: bool = False) -> bool:
        """Later upstream's rejection rule (``--check-for-spiky-loss`` here): ``|result|`` at
        least ``threshold`` times the largest of the first ``num_samples`` values seen for
        ``context``; NaN and infinity are other checks' business."""
        value = math.fabs(_as_float(result))
        if not math.isfinite(value):
            return False
        seen = 0 if resample else self.large_value_counts.get(context, 0)
        if seen >= num_samples:
            return value >= threshold * self.max_values[context]
        largest = value if seen == 0 else max(value, self.max_values[context])
        self.large_value_counts[context], self.max_values[context] = seen + 1, largest
        return False

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self, data_iterator: DataIteratorArgType = None,
                   use_dist_ckpt: bool = False) -> Any:
        """The state to checkpoint, in megatron-core 0.11's layout (plus, where there is
        something to keep, ``failures_by_rank`` and the spiky-loss statistics). With
        ``use_dist_ckpt`` it is wrapped as upstream's sharded object of this (pp, tp) rank."""
        iterators = self._rerun_iterators(data_iterator)
        state: dict[str, Any] = {"mode": self.mode, "state": self.state,
                                 "current_iteration": self.current_iteration}
        state.update((name, getattr(self, name)) for name in _PER_RANK_FIELDS)
        state["error_injector_checkpoint"] = self.error_injector.state_dict()
        state["data_iterator_checkpoints"] = ([it.state_dict() for it in iterators]
                                              if iterators else None)
        if self.failures_by_rank is not None:
            state["failures_by_rank"] = self.failures_by_rank
        if self.max_values:
            state["large_value_counts"] = dict(self.large_value_counts)
            state["max_values"] = dict(self.max_values)
        if not use_dist_ckpt:
            return state
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        return ShardedObject(
            "rerun_state_machine_state", state,
            (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size()),
            (parallel_state.get_pipeline_model_parallel_rank(),
             parallel_state.get_tensor_model_parallel_rank()),
            replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a checkpoint's state (megatron-core 0.11's layout, or later upstream's with the
        per-rank part under ``sharded``); ignored while disabled, as upstream does. A state that
        waits for a re-run must be resumed by as many ranks as saved it."""
        if self.mode == RerunMode.DISABLED:
            return
        per_rank = state_dict.get("sharded", state_dict)
        state = RerunState(state_dict["state"])
        world = dist.get_world_size() if dist.is_initialized() else 1
        failures = state_dict.get("failures_by_rank")
        saved_world = world if failures is None else len(failures)
        if state != RerunState.NOT_RUNNING_YET and saved_world != world:
            raise ValueError(f"the checkpoint was saved to re-run iteration "
                             f"{state_dict['current_iteration'] + 1} on {saved_world} ranks; "
                             f"resume it with the same ranks and parallel sizes (now {world})")
        _log_rank0(logging.WARNING, "Getting RerunStateMachine state from checkpoint, args rerun "
                   "options ignored")
        self.mode = RerunMode(state_dict["mode"])
        self.state = state
        self.current_iteration = state_dict["current_iteration"]
        for name in _PER_RANK_FIELDS:
            setattr(self, name, per_rank.get(name))  # later upstream keeps no last_loss
        self.error_injector.load_state_dict(per_rank["error_injector_checkpoint"])
        self.large_value_counts = dict(per_rank.get("large_value_counts") or {})
        self.max_values = dict(per_rank.get("max_values") or {})
        self.failures_by_rank = failures
        if failures is not None:
            mine = failures[_rank()] or {}
            self.failed_validation_call = mine.get("call")
            self.initial_result = mine.get("initial_result")
            self.suspicious_node = mine.get("node")
            self.suspicious_device = mine.get("device")
        # The resumed sampler reads the iteration's samples again; nothing is replayed.
        self.data_iterator_checkpoints = None

    # -- internals ----------------------------------------------------------------------------

    def _rerun_iterators(self, data_iterator: DataIteratorArgType) -> list[RerunDataIterator]:
        """The iteration's RerunDataIterators; any other iterator only while disabled."""
        if data_iterator is None:
            return []
        candidates = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        iterators = [it for it in candidates if it is not None]
        if self.mode == RerunMode.DISABLED:
            return [it for it in iterators if isinstance(it, RerunDataIterator)]
        for it in iterators:
            if not isinstance(it, RerunDataIterator):
                raise TypeError(f"--rerun-mode {self.mode.value} replays an iteration's data: "
                                f"wrap the data iterator in RerunDataIterator (got "
                                f"{type(it).__name__})")
        return iterators

    @staticmethod
    def _rewind(iterators: list[RerunDataIterator]) -> None:
        for iterator in iterators:
            iterator.rewind()

    def _any_rank(self, flag: bool) -> bool:
        return self._reduce_max(int(flag)) > 0

    def _verdict(self) -> int:
        """The highest conclusion of any rank after a re-run (see ``_NOTHING`` .. )."""
        if self.checkpoint_requested or self.restart_again_requested:
            mine = _CHECKPOINT
        elif self.stop_requested:
            mine = _STOP
        else:
            mine = _CONTINUE if self.continue_requested else _NOTHING
        return self._reduce_max(mine)

    @staticmethod
    def _reduce_max(value: int) -> int:
        if not dist.is_initialized():
            return value
        from megatron.core.utils import collective_device

        tensor = torch.tensor([value], dtype=torch.int32, device=collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def _share_failures(self) -> None:
        """Every rank's failure into every rank's state: a checkpoint keeps one copy per
        (pp, tp) rank, and the rank that failed must find its own after the resume."""
        mine = None
        if self.failed_validation_call is not None:
            mine = {"call": self.failed_validation_call, "initial_result": self.initial_result,
                    "node": self.suspicious_node, "device": self.suspicious_device}
        if not dist.is_initialized():
            self.failures_by_rank = [mine]
            return
        self.failures_by_rank = [None] * dist.get_world_size()
        dist.all_gather_object(self.failures_by_rank, mine)

    def _call_of_caller(self) -> Call:
        frame = sys._getframe(2)  # validate_result's caller
        caller = Caller(frame.f_code.co_filename, frame.f_lineno, _rank())
        self.validation_counts[caller] += 1
        return Call(caller, self.validation_counts[caller])

    def _save_state(self) -> None:
        self.saved_state = {
            "random": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "other": self.state_save_func() if self.state_save_func else None,
        }

    def _restore_state(self) -> None:
        saved = self.saved_state
        random.setstate(saved["random"])
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["torch"])
        if saved["cuda"] is not None:
            torch.cuda.set_rng_state(saved["cuda"])
        if saved["other"] is not None and self.state_restore_func:
            self.state_restore_func(saved["other"])

    def _maybe_report_stats(self) -> None:
        if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS:
            return
        if dist.is_initialized():
            gathered: Optional[list] = ([None] * dist.get_world_size() if _rank() == 0
                                        else None)
            dist.gather_object(dict(self.stats), gathered, dst=0)
            if _rank() != 0:
                for stats in self.stats.values():
                    stats.reset()
                return
            for other in gathered[1:]:
                for caller, stats in other.items():
                    self.stats[caller].combine([stats])
        logger.warning("Stats on computation determinism in validation calls")
        for caller, stats in self.stats.items():
            logger.warning(f"  From {caller.filename}, line {caller.lineno}:")
            logger.warning(f"    {stats.print_stats()}")


def _detached(result: Any) -> Any:
    return result.detach().to("cpu", copy=True) if torch.is_tensor(result) else result


class RerunErrorInjector:
    """Fault injection for testing the machine (``--error-injection-rate N``: about one
    validation in N of an initial run is rejected, at most one at a time, then the re-runs
    behave as ``--error-injection-type`` says)."""

    _NAMES = {RerunDiagnostic.CORRECT_RESULT: "Expected result",
              RerunDiagnostic.TRANSIENT_ERROR: "Transient error",
              RerunDiagnostic.PERSISTENT_ERROR: "Persistent error"}

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR) -> None:
        if error_injection_rate < 0:
            raise ValueError(f"the error injection rate must be >= 0, got {error_injection_rate}")
        self.error_injection_rate = error_injection_rate
        self.error_injection_type = RerunDiagnostic(error_injection_type)
        self.injected_error_type: Optional[RerunDiagnostic] = None

    @property
    def should_inject_errors(self) -> bool:
        return self.error_injection_rate > 0

    def maybe_inject(self) -> bool:
        if not self.should_inject_errors or self.injected_error_type is not None:
            return False
        draw = random.randint(0, self.error_injection_rate - 1)
        if (draw + _rank()) % self.error_injection_rate:
            return False
        self.injected_error_type = self.error_injection_type
        logger.warning(f"Injecting error type {self._NAMES[self.error_injection_type]}")
        return True

    def maybe_miscompare(self, comparison_func: Callable[[Any, Any], float], initial_result: Any,
                         result: Any, state: RerunState) -> float:
        """The comparison, or the one an injected fault of this type would give."""
        injected = self.injected_error_type
        if injected is None:
            return comparison_func(initial_result, result)
        if state == RerunState.RERUNNING_IN_PLACE:
            if injected == RerunDiagnostic.TRANSIENT_ERROR:
                self.injected_error_type = None
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        self.injected_error_type = None
        return (COMPARISON_MISMATCH if injected == RerunDiagnostic.PERSISTENT_ERROR
                else COMPARISON_MATCH)

    def state_dict(self) -> dict[str, Any]:
        return {"error_injection_rate": self.error_injection_rate,
                "error_injection_type": self.error_injection_type,
                "injected_error_type": self.injected_error_type}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.error_injection_rate = state_dict["error_injection_rate"]
        self.error_injection_type = RerunDiagnostic(state_dict["error_injection_type"])
        injected = state_dict["injected_error_type"]
        self.injected_error_type = None if injected is None else RerunDiagnostic(injected)


_MACHINE: Optional[RerunStateMachine] = None


def initialize_rerun_state_machine(**kwargs) -> None:
    """Create the process's machine (``RerunStateMachine``'s arguments)."""
    global _MACHINE
    _MACHINE = RerunStateMachine(**kwargs)


def destroy_rerun_state_machine() -> None:
    global _MACHINE
    _MACHINE = None


def get_rerun_state_machine() -> RerunStateMachine:
    """The process's machine; a disabled one if none was initialized."""
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = RerunStateMachine()
    return _MACHINE
