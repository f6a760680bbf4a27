"""Parts of the rerun state machine (``megatron.core.rerun_state_machine``)."""
