"""megatron-core 0.11's rerun state machine, in the one mode this tree runs: disabled.

Upstream re-runs an iteration whose result fails a validation (a NaN loss, say) to tell a
transient hardware fault from a persistent one, and checkpoints the machine's state with every
save: as a pickled dict in the legacy ``torch`` format and as the sharded object
``rerun_state_machine_state`` in ``torch_dist``. The enums below pickle under upstream's module
path, so checkpoints written here load in upstream and upstream's load here without importing
upstream; the state this tree writes is that of a machine that never left ``DISABLED`` (this
tree stops the run on a NaN loss instead, ``--check-for-nan-in-loss-and-grad``).
"""

from __future__ import annotations

import enum
from typing import Any, Optional


class RerunDiagnostic(str, enum.Enum):
    """What a re-run found: the result was right, or the fault did or did not reproduce."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, enum.Enum):
    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


# Where the machine is in a re-run (this tree never leaves NOT_RUNNING_YET). Pickles carry the
# value, so the values are upstream's; so are the names, for code that uses them.
RerunState = enum.Enum("RerunState", [
    (name, value) for value, name in enumerate((
        "NOT_RUNNING_YET", "INITIAL_RUN", "RERUNNING_IN_PLACE", "WILL_RERUN_FROM_CHECKPOINT",
        "RERUNNING_FROM_CHECKPOINT", "RERUNNING_AGAIN_FROM_CHECKPOINT"))],
    module=__name__, qualname="RerunState")


class RerunErrorInjector:
    """Upstream's fault injector, kept for its checkpointed state: it never injects here."""

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR):
        if error_injection_rate:
            raise ValueError("error injection needs the rerun state machine, which this tree "
                             "runs disabled only")
        self.error_injection_rate = 0
        self.error_injection_type = error_injection_type
        self.injected_error_type: Optional[RerunDiagnostic] = None

    def state_dict(self) -> dict[str, Any]:
        return {"error_injection_rate": self.error_injection_rate,
                "error_injection_type": self.error_injection_type,
                "injected_error_type": self.injected_error_type}


class RerunStateMachine:
    """The disabled machine: saves upstream's state layout, ignores a loaded state (as
    upstream's disabled machine does)."""

    def __init__(self, mode: RerunMode = RerunMode.DISABLED,
                 error_injector: Optional[RerunErrorInjector] = None, **_unused) -> None:
        if mode != RerunMode.DISABLED:
            raise ValueError(f"rerun mode {mode.value!r} is not available in this tree; only "
                             f"'disabled' is")
        self.mode = mode
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        self.error_injector = error_injector or RerunErrorInjector()

    def get_mode(self) -> RerunMode:
        return self.mode

    def state_dict(self, data_iterator: Any = None, use_dist_ckpt: bool = False) -> dict:
        """Upstream's checkpointed fields, as a machine that never ran a validation has them.
        (Wrapping for ``torch_dist`` is the checkpoint writer's job here.)"""
        del data_iterator, use_dist_ckpt
        return {
            "mode": self.mode, "state": self.state, "current_iteration": self.current_iteration,
            "rerun_requested": False, "checkpoint_requested": False,
            "restart_again_requested": False, "continue_requested": False,
            "error_injector_checkpoint": self.error_injector.state_dict(),
            "failed_validation_call": None, "initial_result": None,
            "suspicious_node": None, "suspicious_device": None,
            "data_iterator_checkpoints": None, "last_loss": None,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Nothing to restore while disabled (upstream ignores it too)."""
        del state_dict


_MACHINE: Optional[RerunStateMachine] = None


def initialize_rerun_state_machine(**kwargs) -> None:
    global _MACHINE
    _MACHINE = RerunStateMachine(**kwargs)


def get_rerun_state_machine() -> RerunStateMachine:
    global _MACHINE
    if _MACHINE is None:
        _MACHINE = RerunStateMachine()
    return _MACHINE
