"""The trainer's pre-flight: the layout is proven before any model or process group is built."""

import types

import pytest

from megatron.core.pipeline_parallel import verify as verifier
from megatron.core.pipeline_parallel.upstream_plans import upstream_batched_order
from megatron.training import training


@pytest.fixture(autouse=True)
def fresh_trainer(monkeypatch):
    # The trainer proves each microbatch count once per process; every test is a new job.
    monkeypatch.setattr(training, "_VERIFIED_MICROBATCH_COUNTS", set())


def check(args) -> None:
    microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    training.preflight_pipeline_check(args, microbatches)


def trainer_args(pp, vpp, global_batch, **overrides):
    values = dict(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                  global_batch_size=global_batch, micro_batch_size=1, data_parallel_size=1,
                  overlap_p2p_comm=False, batch_p2p_comm=True,
                  microbatch_group_size_per_vp_stage=None, variable_seq_lengths=True,
                  distributed_backend="nccl")
    values.update(overrides)
    return types.SimpleNamespace(**values)


@pytest.mark.parametrize("pp,vpp,m,overlap", [
    (2, 2, 4, False), (2, 2, 4, True), (4, 2, 8, False), (3, None, 5, False), (8, 4, 64, True),
])
def test_our_layouts_pass(pp, vpp, m, overlap):
    check(trainer_args(pp, vpp, m, overlap_p2p_comm=overlap, batch_p2p_comm=not overlap))


def test_a_crossing_order_is_refused_with_the_verifiers_report(monkeypatch):
    # Upstream's batched order in place of ours: pretrain() must stop before building anything.
    def upstream_order(layout, *, transport):
        return verifier.verify(layout, transport=transport, ordering=upstream_batched_order)
    monkeypatch.setattr(training, "verify", upstream_order)
    with pytest.raises(verifier.VerificationError, match="crossed on channel"):
        check(trainer_args(2, 2, 4))
    check(trainer_args(4, 2, 8))  # the crossing is pp2-only


def test_the_check_models_the_jobs_transport(monkeypatch):
    seen = []
    monkeypatch.setattr(training, "verify", lambda layout, *, transport: seen.append(
        (str(layout), transport)))
    check(trainer_args(2, 2, 4, distributed_backend="gloo"))
    check(trainer_args(4, None, 8, overlap_p2p_comm=True, batch_p2p_comm=False))
    assert seen == [("pp=2 vpp=2 m=4 variable batched", "gloo"),
                    ("pp=4 vpp=1 m=8 variable overlapped", "nccl")]


def test_pipeline_size_one_needs_no_check(monkeypatch):
    monkeypatch.setattr(training, "verify", lambda *a, **k: pytest.fail("checked pp1"))
    check(trainer_args(1, None, 4))
