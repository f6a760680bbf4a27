"""The pipeline wire format on its own: headers, shape checks and payload views (no processes)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.pipeline_parallel.ordering import Kind
from megatron.core.pipeline_parallel.p2p_wire import (
    Endpoints, PipelineShapeError, Tag, check_shape, empty_header, make_header, payload_view,
    read_header,
)

ENDS = Endpoints(sender="pipeline rank 0 (global rank 0)",
                 receiver="pipeline rank 1 (global rank 2)")


def words_of(tensor: torch.Tensor, kind: Kind, microbatch: int | None = None) -> list[int]:
    return make_header(tensor, Tag(kind, -1 if microbatch is None else microbatch)).tolist()


# ------------------------------------------------------------------ headers


@pytest.mark.parametrize("shape", [(5, 2, 3), (1, 1, 1), (0, 2, 3), (7,), (2, 3, 4, 5), ()])
@pytest.mark.parametrize("kind", list(Kind))
def test_header_round_trip_gives_the_sent_shape(shape, kind):
    words = words_of(torch.zeros(shape), kind, microbatch=3)
    assert read_header(words, expected=Tag(kind), ends=ENDS) == list(shape)


def test_header_is_a_cpu_int64_tensor_that_fits_the_empty_receive_header():
    header = make_header(torch.zeros(4, 2, 3), Tag(Kind.ACTIVATION))
    receive = empty_header(torch.device("cpu"))
    assert header.dtype == torch.int64 and header.device.type == "cpu"
    assert header.shape == receive.shape and receive.dtype == torch.int64


def test_header_without_microbatch_still_round_trips():
    words = words_of(torch.zeros(6, 1, 8), Kind.GRADIENT, microbatch=None)
    assert read_header(words, expected=Tag(Kind.GRADIENT), ends=ENDS) == [6, 1, 8]


def test_header_rejects_tensors_with_too_many_dimensions():
    with pytest.raises(PipelineShapeError, match="at most 6 dimensions, got 7"):
        make_header(torch.zeros(1, 1, 1, 1, 1, 1, 1), Tag(Kind.ACTIVATION))


@pytest.mark.parametrize("sent, expected", [(Kind.GRADIENT, Kind.ACTIVATION),
                                            (Kind.ACTIVATION, Kind.GRADIENT)])
def test_header_of_the_other_kind_is_reported_as_crossed(sent, expected):
    words = words_of(torch.zeros(5, 2, 3), sent)
    with pytest.raises(PipelineShapeError) as info:
        read_header(words, expected=Tag(expected), ends=ENDS)
    message = str(info.value)
    assert "crossed" in message
    article = {Kind.ACTIVATION: "an", Kind.GRADIENT: "a"}
    assert f"expected {article[expected]} {expected.value}" in message
    assert f"received {article[sent]} {sent.value}" in message
    assert ENDS.sender in message and ENDS.receiver in message


def test_header_with_an_unknown_kind_code_is_reported_as_corrupt_and_crossed():
    words = words_of(torch.zeros(5, 2, 3), Kind.ACTIVATION)
    words[1] = 99
    with pytest.raises(PipelineShapeError, match="crossed.*corrupt header"):
        read_header(words, expected=Tag(Kind.ACTIVATION), ends=ENDS)


def test_words_without_the_magic_are_not_a_pipeline_header():
    # What arrives when the peer sends a bare payload (variable_seq_lengths off on its side).
    words = torch.full((16,), 1.5).view(torch.int64).tolist()
    with pytest.raises(PipelineShapeError) as info:
        read_header(words, expected=Tag(Kind.ACTIVATION), ends=ENDS)
    message = str(info.value)
    assert "not a pipeline tensor header" in message
    assert "variable_seq_lengths and --p2p-debug-tags must be the same on every rank" in message
    assert ENDS.sender in message and ENDS.receiver in message


@pytest.mark.parametrize("ndim", [-1, 7])
def test_header_with_an_impossible_ndim_is_corrupt(ndim):
    words = words_of(torch.zeros(5, 2, 3), Kind.ACTIVATION)
    words[5] = ndim
    with pytest.raises(PipelineShapeError, match=f"corrupt pipeline header.*ndim={ndim}"):
        read_header(words, expected=Tag(Kind.ACTIVATION), ends=ENDS)


# ------------------------------------------------------------------ check_shape, fixed


def test_fixed_shape_accepts_exactly_the_expected_shape():
    check_shape(torch.Size([4, 2, 3]), (4, 2, 3), variable=False, kind=Kind.ACTIVATION,
                ends=ENDS, what="")


@pytest.mark.parametrize("actual",
                         [(3, 2, 3), (5, 2, 3), (4, 1, 3), (4, 2, 4), (4, 2), (4, 2, 3, 1)])
def test_fixed_shape_rejects_any_difference_and_explains_it(actual):
    with pytest.raises(PipelineShapeError) as info:
        check_shape(actual, (4, 2, 3), variable=False, kind=Kind.GRADIENT, ends=ENDS,
                    what="of microbatch 2 ")
    message = str(info.value)
    shown_actual = "[" + ", ".join(map(str, actual)) + "]"
    assert f"has shape {shown_actual}" in message
    assert "expects [4, 2, 3]" in message
    assert "pipeline gradient of microbatch 2 from" in message
    assert ENDS.sender in message and ENDS.receiver in message
    assert "--variable-seq-lengths" in message
    assert "--seq-length" not in message


# ------------------------------------------------------------------ check_shape, variable


@pytest.mark.parametrize("actual", [(8, 2, 3), (1, 2, 3), (0, 2, 3), (5, 2, 3)])
def test_variable_shape_accepts_any_sequence_length_up_to_the_maximum(actual):
    check_shape(actual, (8, 2, 3), variable=True, kind=Kind.ACTIVATION, ends=ENDS, what="")


@pytest.mark.parametrize("actual, why", [
    ((9, 2, 3), "sequence longer than the maximum"),
    ((5, 1, 3), "micro batch size differs"),
    ((5, 2, 4), "hidden size differs"),
    ((5, 2), "fewer dimensions"),
    ((5, 2, 3, 1), "more dimensions"),
])
def test_variable_shape_rejects_and_explains(actual, why):
    with pytest.raises(PipelineShapeError) as info:
        check_shape(actual, (8, 2, 3), variable=True, kind=Kind.ACTIVATION, ends=ENDS, what="")
    message = str(info.value)
    shown_actual = "[" + ", ".join(map(str, actual)) + "]"
    assert f"has shape {shown_actual}" in message, why
    assert "expects [<=8, 2, 3]" in message, why
    assert "pipeline activation from" in message, why
    assert ENDS.sender in message and ENDS.receiver in message, why
    assert "--seq-length" in message, why
    assert "--variable-seq-lengths" not in message, why


def test_check_shape_accepts_torch_sizes_lists_and_tuples_alike():
    for expected in (torch.Size([8, 2, 3]), [8, 2, 3], (8, 2, 3)):
        check_shape([6, 2, 3], expected, variable=True, kind=Kind.GRADIENT, ends=ENDS, what="")


# ------------------------------------------------------------------ payload_view


def test_payload_view_is_the_leading_elements_reshaped_without_a_copy():
    buffer = torch.arange(48, dtype=torch.float32)
    view = payload_view(buffer, [5, 2, 3])
    assert view.shape == (5, 2, 3)
    assert torch.equal(view.reshape(-1), torch.arange(30, dtype=torch.float32))
    assert view.data_ptr() == buffer.data_ptr()


def test_payload_view_of_the_full_capacity_and_of_nothing():
    buffer = torch.arange(48, dtype=torch.float32)
    assert torch.equal(payload_view(buffer, (8, 2, 3)), buffer.view(8, 2, 3))
    assert payload_view(buffer, (0, 2, 3)).shape == (0, 2, 3)


def test_payload_view_flattens_a_shaped_buffer_first():
    buffer = torch.arange(24, dtype=torch.float32).view(4, 2, 3)
    assert torch.equal(payload_view(buffer, (2, 2, 3)), buffer[:2])


def test_header_names_the_tensor_and_a_different_one_is_crossed():
    sent = Tag(Kind.ACTIVATION, 4, 0, 1)
    words = make_header(torch.zeros(2, 1, 3), sent).tolist()
    assert read_header(words, expected=sent, ends=ENDS) == [2, 1, 3]
    with pytest.raises(PipelineShapeError,
                       match=r"expected an activation of microbatch 3 \(stage 0->1\) .* but "
                             r"received an activation of microbatch 4 \(stage 0->1\)"):
        read_header(words, expected=Tag(Kind.ACTIVATION, 3, 0, 1), ends=ENDS)
