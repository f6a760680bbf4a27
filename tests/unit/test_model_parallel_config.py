"""ModelParallelConfig: 0.11-compatible fields and defaults, derived values, validation."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from megatron.core import ModelParallelConfig
from megatron.core.model_parallel_config import UNSUPPORTED_FEATURES

# Every field megatron-core 0.11's ModelParallelConfig declares, in its order.
FIELDS_OF_CORE_0_11 = [
    "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "sequence_parallel", "context_parallel_size",
    "hierarchical_context_parallel_sizes", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "moe_extended_tp", "perform_initialization",
    "use_cpu_initialization", "fp16", "bf16", "params_dtype", "timers",
    "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func",
    "param_sync_func", "deterministic_mode", "enable_autocast", "autocast_dtype",
    "num_microbatches_with_partial_activation_checkpoints", "gradient_accumulation_fusion",
    "async_tensor_model_parallel_allreduce", "use_te_rng_tracker", "tp_comm_overlap",
    "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
    "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs",
    "tp_comm_atomic_rs", "cross_entropy_loss_fusion", "tp_comm_overlap_disable_qkv",
    "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend", "pipeline_dtype",
    "variable_seq_lengths", "overlap_p2p_comm", "batch_p2p_comm", "batch_p2p_sync",
    "use_ring_exchange_p2p", "deallocate_pipeline_outputs", "defer_embedding_wgrad_compute",
    "wgrad_deferral_limit", "pipeline_model_parallel_split_rank",
    "overlap_p2p_comm_warmup_flush", "microbatch_group_size_per_vp_stage", "cpu_offloading",
    "cpu_offloading_num_layers", "_cpu_offloading_context", "cpu_offloading_activations",
    "cpu_offloading_weights", "barrier_with_L1_time",
]

# A pipelined config every rule below starts from.
PIPELINED = dict(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)


def test_fields_match_core_0_11_in_order():
    assert [f.name for f in dataclasses.fields(ModelParallelConfig)] == FIELDS_OF_CORE_0_11


@pytest.mark.parametrize(
    "name, default",
    [
        ("tensor_model_parallel_size", 1),
        ("pipeline_model_parallel_size", 1),
        ("virtual_pipeline_model_parallel_size", None),
        ("sequence_parallel", False),
        ("params_dtype", torch.float32),
        ("perform_initialization", True),
        ("pipeline_dtype", None),
        ("variable_seq_lengths", False),
        ("overlap_p2p_comm", False),
        ("batch_p2p_comm", True),
        ("batch_p2p_sync", True),
        ("deallocate_pipeline_outputs", False),
        ("wgrad_deferral_limit", 0),
        ("tp_comm_bulk_wgrad", True),
        ("tp_comm_bootstrap_backend", "nccl"),
        ("cpu_offloading_weights", True),
        ("barrier_with_L1_time", True),
    ],
)
def test_defaults_match_core_0_11(name, default):
    assert getattr(ModelParallelConfig(), name) == default


def test_derived_defaults_follow_their_sources():
    config = ModelParallelConfig(
        tensor_model_parallel_size=4, params_dtype=torch.bfloat16, **PIPELINED
    )
    assert config.expert_tensor_parallel_size == 4
    assert config.autocast_dtype == torch.bfloat16
    assert config.microbatch_group_size_per_vp_stage == 2


def test_explicit_values_are_kept():
    config = ModelParallelConfig(
        autocast_dtype=torch.float16,
        microbatch_group_size_per_vp_stage=5,
        virtual_pipeline_model_parallel_size=2,
        **PIPELINED,
    )
    assert config.autocast_dtype == torch.float16
    assert config.microbatch_group_size_per_vp_stage == 5


def test_core_0_11_style_construction_with_many_keywords():
    calls = []
    config = ModelParallelConfig(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=4,
        virtual_pipeline_model_parallel_size=2,
        sequence_parallel=True,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=2,
        perform_initialization=False,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        timers=None,
        finalize_model_grads_func=lambda *a, **k: calls.append("finalize"),
        grad_scale_func=lambda loss: loss * 2,
        no_sync_func=None,
        grad_sync_func=None,
        param_sync_func=None,
        deterministic_mode=True,
        enable_autocast=False,
        gradient_accumulation_fusion=False,
        async_tensor_model_parallel_allreduce=False,
        use_te_rng_tracker=False,
        tp_comm_overlap=False,
        cross_entropy_loss_fusion=False,
        variable_seq_lengths=True,
        overlap_p2p_comm=True,
        batch_p2p_comm=False,
        batch_p2p_sync=True,
        deallocate_pipeline_outputs=True,
        overlap_p2p_comm_warmup_flush=True,
        microbatch_group_size_per_vp_stage=4,
        cpu_offloading=False,
        barrier_with_L1_time=False,
    )
    assert config.pipeline_model_parallel_size == 4
    assert config.autocast_dtype == torch.bfloat16
    config.finalize_model_grads_func()
    assert calls == ["finalize"]


def test_interleaving_at_pp2_with_variable_lengths_and_batched_p2p_is_allowed():
    config = ModelParallelConfig(
        virtual_pipeline_model_parallel_size=2,
        variable_seq_lengths=True,
        batch_p2p_comm=True,
        **PIPELINED,
    )
    assert config.virtual_pipeline_model_parallel_size == 2


@pytest.mark.parametrize(
    "kwargs, fields_in_message",
    [
        (dict(tensor_model_parallel_size=0), ["tensor_model_parallel_size"]),
        (dict(pipeline_model_parallel_size=-1), ["pipeline_model_parallel_size"]),
        (dict(context_parallel_size=0), ["context_parallel_size"]),
        (dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 3]),
         ["hierarchical_context_parallel_sizes", "context_parallel_size=4"]),
        (dict(expert_model_parallel_size=0), ["expert_model_parallel_size"]),
        (dict(expert_tensor_parallel_size=0), ["expert_tensor_parallel_size"]),
        (dict(tensor_model_parallel_size=2.0), ["tensor_model_parallel_size"]),
        (dict(tensor_model_parallel_size=True), ["tensor_model_parallel_size"]),
        (dict(virtual_pipeline_model_parallel_size=0, **PIPELINED),
         ["virtual_pipeline_model_parallel_size"]),
        (dict(virtual_pipeline_model_parallel_size=2),
         ["virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size",
          "interleaving needs at least two pipeline stages"]),
        (dict(sequence_parallel=True), ["sequence_parallel", "tensor_model_parallel_size"]),
        (dict(pipeline_model_parallel_size=2), ["pipeline_model_parallel_size", "pipeline_dtype"]),
        (dict(pipeline_dtype=torch.int32), ["pipeline_dtype", "torch.int32"]),
        (dict(pipeline_dtype="float32"), ["pipeline_dtype", "'float32'"]),
        (dict(fp16=True, bf16=True), ["fp16", "bf16"]),
        (dict(overlap_p2p_comm=True),
         ["overlap_p2p_comm", "batch_p2p_comm", "set batch_p2p_comm=False to overlap"]),
        (dict(overlap_p2p_comm_warmup_flush=True),
         ["overlap_p2p_comm_warmup_flush", "overlap_p2p_comm", "batch_p2p_comm"]),
        (dict(overlap_p2p_comm_warmup_flush=True, batch_p2p_comm=False),
         ["overlap_p2p_comm_warmup_flush", "overlap_p2p_comm"]),
        (dict(microbatch_group_size_per_vp_stage=1, **PIPELINED),
         ["microbatch_group_size_per_vp_stage=1", "pipeline_model_parallel_size=2"]),
        (dict(defer_embedding_wgrad_compute=True),
         ["defer_embedding_wgrad_compute=True", "pipeline_model_parallel_size > 1"]),
        (dict(defer_embedding_wgrad_compute=True, wgrad_deferral_limit=-1, **PIPELINED),
         ["wgrad_deferral_limit=-1 must be >= 0"]),
    ],
)
def test_invalid_settings_are_rejected_with_named_fields(kwargs, fields_in_message):
    with pytest.raises(ValueError) as excinfo:
        ModelParallelConfig(**kwargs)
    for text in fields_in_message:
        assert text in str(excinfo.value)


# One non-neutral value per unsupported field.
UNSUPPORTED_VALUES = {
    "expert_model_parallel_size": 2,
    "expert_tensor_parallel_size": 2,
    "moe_extended_tp": True,
    "use_ring_exchange_p2p": True,
    "pipeline_model_parallel_split_rank": 1,
    "cpu_offloading": True,
    "tp_comm_overlap": True,
    "num_microbatches_with_partial_activation_checkpoints": 2,
}


def test_every_unsupported_feature_has_a_case():
    assert set(UNSUPPORTED_VALUES) == set(UNSUPPORTED_FEATURES)


@pytest.mark.parametrize("name, value", sorted(UNSUPPORTED_VALUES.items()))
def test_unsupported_features_are_rejected(name, value):
    with pytest.raises(ValueError) as excinfo:
        ModelParallelConfig(**{name: value})
    message = str(excinfo.value)
    assert message.startswith(f"{name}={value!r} is not supported by this tree: ")
    assert message.endswith(UNSUPPORTED_FEATURES[name].reason)


def test_expert_tensor_parallel_size_equal_to_tensor_parallel_is_accepted():
    config = ModelParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=2)
    assert config.expert_tensor_parallel_size == 2


def test_replace_revalidates():
    valid = ModelParallelConfig(bf16=True, **PIPELINED)
    with pytest.raises(ValueError, match="fp16"):
        dataclasses.replace(valid, fp16=True)
    with pytest.raises(ValueError, match="pipeline_dtype"):
        dataclasses.replace(valid, pipeline_dtype=None)
    with pytest.raises(ValueError, match="hierarchical_context_parallel_sizes"):
        dataclasses.replace(valid, context_parallel_size=2,
                            hierarchical_context_parallel_sizes=[2, 2])


def test_replace_of_a_source_needs_the_derived_field_reset():
    base = ModelParallelConfig()
    # The stored group size (1) is copied and is now too small; the message says what to do.
    with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage=None"):
        dataclasses.replace(base, **PIPELINED)
    deeper = dataclasses.replace(base, microbatch_group_size_per_vp_stage=None, **PIPELINED)
    assert deeper.microbatch_group_size_per_vp_stage == 2


def test_package_root_does_not_import_parallel_state_or_schedules():
    probe = (
        "import sys, megatron.core as core\n"
        "assert core.__all__ == ['ModelParallelConfig', '__version__'], core.__all__\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('megatron.core.'))\n"
        "assert loaded == ['megatron.core.model_parallel_config'], loaded\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)
