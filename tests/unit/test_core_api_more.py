"""More megatron-core 0.11 names that upstream's unit tests import: the microbatch calculator's
error types and helpers, FusedScaleMaskSoftmax and the mask helpers, PackedSeqParams, the DDP
buffer module's partition_buckets, the conditional embedder's gradient all-reduce, the
optimizer-state sharding helpers, apply_swiglu_sharded_factory, MegatronDataset and
megatron.training.utils.unwrap_model. Single process, CPU."""

from __future__ import annotations

import numpy
import pytest
import torch

import megatron.core.num_microbatches_calculator as calc
from megatron.core.datasets.megatron_dataset import MegatronDataset
from megatron.core.datasets.utils import Split
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.distributed.finalize_model_grads import _allreduce_conditional_embedding_grads
from megatron.core.distributed.param_and_grad_buffer import partition_buckets
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.utils import attention_mask_func, get_default_causal_mask
from megatron.training.utils import unwrap_model
from tests.support.gpt_support import small_config


@pytest.fixture(autouse=True)
def fresh_calculator():
    calc.destroy_num_microbatches_calculator()
    yield
    calc.destroy_num_microbatches_calculator()


def test_calculator_errors_are_also_assertion_errors_with_clear_messages():
    calc.init_num_microbatches_calculator(0, None, 32, 8, 2)
    with pytest.raises(AssertionError, match="already initialised"):
        calc.init_num_microbatches_calculator(0, None, 32, 8, 2)
    with pytest.raises(ValueError, match="not a multiple of micro batch size 8"):
        calc.reconfigure_num_microbatches_calculator(0, None, 24, 8, 2)
    ramp = calc._build_num_microbatches_calculator(0, [16, 16, 48], 32, 8, 2, False)
    assert type(ramp) is calc.RampupBatchsizeNumMicroBatchesCalculator
    assert ramp.micro_batch_times_data_parallel_size == 16 and ramp.get() == 1


def test_fused_scale_mask_softmax_masks_the_future_and_keeps_the_dtype():
    softmax = FusedScaleMaskSoftmax(False, True, AttnMaskType.causal, True, attention_mask_func,
                                    softmax_in_fp32=True, scale=2.0)
    scores = torch.zeros(2, 3, 4, 4, dtype=torch.bfloat16)
    probs = softmax(scores, None)
    expected = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5).reshape(-1, 1)
    assert probs.dtype == torch.bfloat16
    assert torch.equal(probs.float(), expected.to(torch.bfloat16).float().expand(2, 3, 4, 4))
    with pytest.raises(AssertionError, match="sq == sk"):
        softmax(torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16), None)
    with pytest.raises(AssertionError, match="needs softmax_in_fp32"):
        FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, False, attention_mask_func,
                              softmax_in_fp32=False, scale=2.0)
    given = torch.tensor([[False, True], [False, False]])
    padded = FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, False,
                                   attention_mask_func, True, None)
    assert torch.allclose(padded(torch.zeros(1, 1, 2, 2), given),
                          torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]]))
    get_default_causal_mask.cache_clear()


def test_packed_seq_params_holds_upstreams_fields():
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3]),
                             max_seqlen_q=3)
    assert params.cu_seqlens_kv is None and params.qkv_format == "thd"


def test_partition_buckets_is_importable_from_the_buffer_module():
    from megatron.core.distributed import bucket_group

    assert partition_buckets is bucket_group.partition_buckets


def test_conditional_embedder_gradients_are_summed_over_chunks():
    chunks = [torch.nn.Linear(3, 3) for _ in range(2)]
    for index, chunk in enumerate(chunks):
        chunk.weight.pipeline_parallel = True
        for param in chunk.parameters():
            param.main_grad = torch.full_like(param, float(index + 1))
    config = ModelParallelConfig(pipeline_model_parallel_size=1)
    _allreduce_conditional_embedding_grads(chunks, config)  # no has_cond_embedder: nothing
    assert torch.equal(chunks[0].weight.main_grad, torch.ones(3, 3))
    config.has_cond_embedder = True
    _allreduce_conditional_embedding_grads(chunks, config)
    for index, chunk in enumerate(chunks):
        assert torch.equal(chunk.weight.main_grad, torch.full((3, 3), 3.0))
        assert torch.equal(chunk.bias.main_grad, torch.full((3,), float(index + 1)))


def test_optimizer_state_becomes_sharded_tensors_under_the_model_keys():
    model = torch.nn.Linear(4, 2)
    entries = {"w": ShardedTensor.from_rank_offsets("layer.weight", model.weight),
               "b": ShardedTensor.from_rank_offsets("layer.bias", model.bias)}
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    adam = torch.optim.Adam(model.parameters())
    adam.step()
    mapping = get_param_id_to_sharded_param_map(entries, adam.param_groups[0]["params"])
    assert mapping == {0: entries["w"], 1: entries["b"]}
    state = adam.state_dict()
    optim_state_to_sharding_state(state, mapping, exclude_keys=("step",))
    keys = {value.key for per_param in state["state"].values() for value in per_param.values()
            if isinstance(value, ShardedTensor)}
    assert keys == {f"optimizer.state.{kind}.layer.{name}" for kind in ("exp_avg", "exp_avg_sq")
                    for name in ("weight", "bias")}
    assert torch.is_tensor(state["state"][0]["step"])
    assert isinstance(state["param_groups"][0]["params"], LocalNonpersistentObject)
    with pytest.raises(CheckpointingException, match="parameter 1 has no entry"):
        optim_state_to_sharding_state(adam.state_dict(), {0: entries["w"]})


def test_swiglu_factory_stores_gate_halves_before_up_halves():
    fc1 = torch.arange(8.0).view(4, 2)  # tensor-parallel rank 1 of 2: [gate; up] rows
    factory = apply_swiglu_sharded_factory(
        ShardedTensor.from_rank_offsets("fc1", fc1, (1, 1, 2), prepend_axis_num=1), ((0, 3, 5),))
    halves = factory.build()
    assert halves["gate"].global_offset == (3, 2, 0) and halves["up"].global_offset == (3, 6, 0)
    assert torch.equal(factory.merge_fn({"gate": fc1[:2], "up": fc1[2:]}), fc1)
    with pytest.raises(CheckpointingException, match="even, equal share"):
        apply_swiglu_sharded_factory(ShardedTensor.from_rank_offsets("odd", torch.ones(3, 2)), ())


def test_megatron_dataset_subclass_gets_identity_and_fields():
    class Squares(MegatronDataset):
        @staticmethod
        def numel_low_level_dataset(low_level_dataset):
            return len(low_level_dataset)

        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            return list(range(10))

        def __len__(self):
            return len(self.indices)

        def __getitem__(self, idx):
            return {"value": numpy.array(self.dataset[self.indices[idx]] ** 2)}

    class Config:
        random_seed, sequence_length, split, split_matrix, tokenizer = 1, 8, "1,0,0", None, None

    dataset = Squares(list(range(10)), "squares", numpy.arange(2, 5), None, Split.train, Config())
    assert len(dataset) == 3 and int(dataset[1]["value"]) == 9
    assert dataset.unique_identifiers["class"] == "Squares"
    assert len(dataset.unique_description_hash) == 32


def test_unwrap_model_takes_off_this_trees_wrappers():
    inner = torch.nn.Linear(2, 2)
    wrapped = Float16Module(small_config(bf16=True), inner)
    assert unwrap_model(wrapped) is inner
    assert unwrap_model([wrapped, inner]) == [inner, inner]


def test_a_config_without_shape_is_accepted_but_builds_no_layer():
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_attention_heads=1, num_layers=1)  # upstream's DDP tests' one
    assert config.hidden_size == 0
    with pytest.raises(ValueError, match="LanguageModelEmbedding needs TransformerConfig"):
        LanguageModelEmbedding(config, vocab_size=8, max_sequence_length=4)


def test_embedding_zero_parameters():
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )

    embedding = LanguageModelEmbedding(small_config(), vocab_size=8, max_sequence_length=4)
    embedding.zero_parameters()
    assert all(not param.any() for param in embedding.parameters())


def test_build_module_builds_specs_classes_and_import_paths():
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module, import_module
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    def double(x):
        return 2 * x

    assert build_module(double) is double
    assert build_module(ModuleSpec(module=double)) is double
    assert isinstance(build_module(IdentityOp, "ignored", size=3), IdentityOp)
    x = torch.ones(2)
    assert build_module(ModuleSpec(module=IdentityOp))(x, "extra") is x
    assert build_module(IdentityFuncOp)()(x) is x
    spec = ModuleSpec(module=("megatron.core.transformer.mlp", "MLP"),
                      submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                               linear_fc2=RowParallelLinear))
    assert isinstance(build_module(spec, config=small_config()), MLP)
    assert import_module(("megatron.core.transformer.mlp", "MLP")) is MLP
    with pytest.raises(ImportError, match="cannot import Nope from megatron.core.transformer"):
        import_module(("megatron.core.transformer.mlp", "Nope"))
    with pytest.raises(TypeError, match="building MLP from its spec"):
        build_module(ModuleSpec(module=MLP, params={"bogus": 1}), config=small_config())


def test_sublayers_return_their_output_bias_unless_the_layer_asks_otherwise():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = small_config()  # biases, no fused bias-dropout-add
    spec = get_gpt_layer_local_spec().submodules
    mlp = MLP(config, spec.mlp.submodules)  # as upstream: the bias comes back separately
    x = torch.randn(3, 2, config.hidden_size)
    output, bias = mlp(x)
    assert bias is not None and bias.shape == (config.hidden_size,)
    folded, none = MLP(config, spec.mlp.submodules, output_bias_in_linear=True)(x)
    assert none is None
    layer = TransformerLayer(config, spec)  # nothing to fuse: the GEMMs add the biases
    assert layer.mlp.linear_fc2.skip_bias_add is False
    assert layer.self_attention.linear_proj.skip_bias_add is False
    fused = TransformerLayer(small_config(bias_dropout_fusion=True, hidden_dropout=0.1), spec)
    assert fused.mlp.linear_fc2.skip_bias_add is True


@pytest.fixture
def one_rank():
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_get_model_wraps_in_the_precision_the_arguments_say(one_rank, monkeypatch):
    from megatron.training import training
    from megatron.training.arguments import parse_args
    from tests.support.gpt_support import build_gpt

    args = parse_args(ignore_unknown_args=True, argv=[])
    args.bf16, args.fp16, args.distributed_backend = True, False, "gloo"
    args.virtual_pipeline_model_parallel_size = None  # validate_args derives it; tests set it
    monkeypatch.setattr(training, "get_args", lambda: args)
    model, = training.get_model(lambda pre_process, post_process: build_gpt(small_config()),
                                wrap_with_ddp=False)
    assert isinstance(model, Float16Module) and model.config.bf16
    assert not model.module.config.bf16  # the provider's own config is left as it was
    assert all(param.dtype == torch.bfloat16 for param in model.parameters())


def test_an_optimizer_without_lr_waits_for_the_scheduler():
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from tests.support.gpt_support import build_gpt

    config = small_config()
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), build_gpt(config))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=None), [model])  # as upstream allows
    assert all(group["lr"] is None for group in optimizer.param_groups)
    with pytest.raises(ValueError, match="no learning rate: OptimizerConfig.lr is None"):
        optimizer.step()
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=0, lr_decay_steps=10,
        lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=10,
        wd_incr_style="constant")
    scheduler.step(1)
    # The scheduler's max_lr and min_lr: a tenth of the way from 1e-3 down to 1e-4.
    assert all(group["lr"] == pytest.approx(1e-3 - 0.9e-3 / 10) for group in optimizer.param_groups)
