"""Bad pipeline configurations fail fast, on every rank, with a message naming the cause."""

from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from tests.distributed.pipeline_cases import HIDDEN, MBS, SEQ, Case, config_for
from tests.launcher import DistributedTestFailure, run_ranks
from tests.support.stacked_model import StageChunk, forward_step_func, make_microbatches


def _attempt(rank, pp, case, *, chunks_override=None, drop_hidden=False, batches=None,
             model_type=None, decoder_seq_length=None, one_iterator=False):
    config = config_for(pp, case)
    if drop_hidden:
        del config.hidden_size
    chunks = [StageChunk(config, HIDDEN, c * pp + rank, pp * case.vpp) for c in range(case.vpp)]
    if chunks_override is not None:
        chunks = chunks[:chunks_override]
    for chunk in chunks if model_type is not None else ():
        chunk.model_type = model_type
    batches = batches or make_microbatches(case.num_microbatches, SEQ, MBS, HIDDEN,
                                           variable=case.variable)
    try:
        get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=[iter(batches) for _ in chunks[:1 if one_iterator else None]]
            if case.vpp > 1 else iter(batches),
            model=chunks if case.vpp > 1 else chunks[0],
            num_microbatches=case.num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
            decoder_seq_length=decoder_seq_length)
    except Exception as error:  # the test wants the message, from every rank
        return f"{type(error).__name__}: {error}"
    return "no error"


def configuration_errors(rank, world_size):
    messages = {}
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size,
                                             virtual_pipeline_model_parallel_size=2)
    messages["microbatches"] = _attempt(rank, world_size, Case(2, 3, False, "batched"))
    messages["chunks"] = _attempt(rank, world_size, Case(2, 4, False, "batched"),
                                  chunks_override=1)
    messages["hidden"] = _attempt(rank, world_size, Case(2, 4, False, "batched"),
                                  drop_hidden=True)
    messages["encoder-decoder"] = _attempt(rank, world_size, Case(2, 4, False, "batched"),
                                           model_type=ModelType.encoder_and_decoder)
    messages["decoder length"] = _attempt(rank, world_size, Case(2, 4, False, "batched"),
                                          decoder_seq_length=SEQ // 2)
    messages["iterators"] = _attempt(rank, world_size, Case(2, 4, False, "batched"),
                                     one_iterator=True)
    parallel_state.destroy_model_parallel()
    return messages


def test_configuration_errors_are_raised_on_every_rank_before_any_communication():
    for messages in run_ranks(configuration_errors, 4, timeout_s=60):
        assert "ValueError" in messages["microbatches"]
        assert "microbatch_group_size_per_vp_stage" in messages["microbatches"]
        assert "virtual pipeline size is 2 but 1 model chunks" in messages["chunks"]
        assert "hidden_size" in messages["hidden"]
        # Upstream raises RuntimeError for these (its unit tests expect that type).
        assert messages["encoder-decoder"].startswith("ScheduleRequestError: encoder-decoder")
        assert messages["decoder length"].startswith("ScheduleRequestError: decoder_seq_length")
        assert messages["iterators"].startswith("ScheduleRequestError: got 2 model chunks but 1")


def unequal_lengths_without_variable_flag(rank, world_size):
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world_size)
    case = Case(1, 2, False, "batched")
    batches = make_microbatches(2, SEQ, MBS, HIDDEN, variable=True, seed=3)
    assert any(x.shape[0] != SEQ for x, _ in batches)
    return _attempt(rank, world_size, case, batches=batches)


def test_unequal_lengths_without_variable_seq_lengths_name_the_flag():
    try:
        messages = run_ranks(unequal_lengths_without_variable_flag, 2, timeout_s=60)
    except DistributedTestFailure as failure:  # the peer may die on the closed connection
        messages = [str(failure)]
    sender = next(m for m in messages if "PipelineShapeError" in m)
    assert "--variable-seq-lengths" in sender
    assert "from pipeline rank 0 (global rank 0) to pipeline rank 1 (global rank 1)" in sender
    assert f"the receiver expects [{SEQ}, {MBS}, {HIDDEN}]" in sender
