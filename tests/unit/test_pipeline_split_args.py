"""The pipeline-split and deferral flags: checked in flag names, carried into the model config,
and proven by the trainer's pre-flight verifier like every other layout."""

import pytest

from megatron.training import training
from megatron.training.arguments import ArgumentError, parse_args, validate_args
from megatron.training.config_builders import core_transformer_config_from_args

BASE = ["--distributed-backend", "gloo", "--transformer-impl", "local", "--hidden-size", "64",
        "--num-attention-heads", "4", "--micro-batch-size", "1", "--global-batch-size", "8"]


@pytest.fixture
def world(monkeypatch):
    def set_world(size):
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("RANK", "0")
    return set_world


def validated(*argv):
    return validate_args(parse_args(argv=[*BASE, *argv]))


LAYOUTS = [  # (world size, flags); tests/distributed/test_gpt_split trains such layouts
    (4, ["--num-layers", "12", "--pipeline-model-parallel-size", "4",
         "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"]),
    (4, ["--num-layers", "6", "--pipeline-model-parallel-size", "4",
         "--num-virtual-stages-per-pipeline-rank", "2", "--account-for-embedding-in-pipeline-split",
         "--account-for-loss-in-pipeline-split"]),
    (2, ["--num-layers", "6", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "2", "--account-for-embedding-in-pipeline-split",
         "--account-for-loss-in-pipeline-split", "--no-overlap-p2p-communication"]),
    (2, ["--num-layers", "5", "--pipeline-model-parallel-size", "2",
         "--decoder-last-pipeline-num-layers", "1", "--defer-embedding-wgrad-compute",
         "--wgrad-deferral-limit", "2", "--variable-seq-lengths"]),
]


@pytest.mark.parametrize("size, argv", LAYOUTS)
def test_layouts_reach_the_config_and_pass_the_preflight(world, monkeypatch, size, argv):
    world(size)
    args = validated(*argv)
    config = core_transformer_config_from_args(args)
    assert config.num_layers_in_first_pipeline_stage == args.decoder_first_pipeline_num_layers
    assert config.num_layers_in_last_pipeline_stage == args.decoder_last_pipeline_num_layers
    assert config.account_for_embedding_in_pipeline_split == \
        args.account_for_embedding_in_pipeline_split
    assert config.account_for_loss_in_pipeline_split == args.account_for_loss_in_pipeline_split
    assert config.defer_embedding_wgrad_compute == args.defer_embedding_wgrad_compute
    assert config.wgrad_deferral_limit == args.wgrad_deferral_limit
    microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    for transport in ("gloo", "nccl"):
        args.distributed_backend = transport
        monkeypatch.setattr(training, "_VERIFIED_MICROBATCH_COUNTS", set())  # a new job
        training.preflight_pipeline_check(args, microbatches)  # raises VerificationError


def test_num_layers_per_virtual_stage_counts_the_embedding_and_loss(world):
    world(2)
    args = validated(*LAYOUTS[2][1])
    assert args.virtual_pipeline_model_parallel_size == 2  # 8 slots / pp 2 / 2 per stage


@pytest.mark.parametrize("size, argv, message", [
    (4, ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
         "--account-for-embedding-in-pipeline-split"],
     "--num-layers 8 plus 1 for the embedding/loss (= 9 slots) does not divide evenly over "
     "--pipeline-model-parallel-size 4 = 4 model chunks"),
    (4, ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
         "--num-virtual-stages-per-pipeline-rank", "2", "--account-for-loss-in-pipeline-split"],
     "over --pipeline-model-parallel-size 4 x --num-virtual-stages-per-pipeline-rank 2"),
    (4, ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
         "--decoder-first-pipeline-num-layers", "2", "--account-for-loss-in-pipeline-split"],
     "--decoder-first-pipeline-num-layers 2 and --account-for-loss-in-pipeline-split are "
     "alternative ways"),
    (4, ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
         "--decoder-first-pipeline-num-layers", "3"],
     "the 5 layers left for the 3 middle pipeline ranks (--num-layers 8 minus "
     "--decoder-first-pipeline-num-layers 3) do not divide evenly"),
    (4, ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
         "--num-virtual-stages-per-pipeline-rank", "2", "--decoder-last-pipeline-num-layers",
         "3"], "--decoder-last-pipeline-num-layers 3 must be >= 1 and a multiple of the "
               "virtual pipeline size 2"),
    (4, ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
         "--num-layers-per-virtual-pipeline-stage", "1", "--decoder-first-pipeline-num-layers",
         "2"], "take --num-virtual-stages-per-pipeline-rank for interleaving"),
    (3, ["--num-layers", "4", "--pipeline-model-parallel-size", "3",
         "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2"],
     "leave pipeline ranks [1] of --pipeline-model-parallel-size 3 without layers"),
    (1, ["--num-layers", "4", "--decoder-last-pipeline-num-layers", "2"],
     "--decoder-last-pipeline-num-layers 2 needs --pipeline-model-parallel-size 1 >= 2"),
    (1, ["--num-layers", "4", "--defer-embedding-wgrad-compute"],
     "--defer-embedding-wgrad-compute moves the output layer's weight-gradient GEMMs into the "
     "pipeline flush, so it needs --pipeline-model-parallel-size >= 2"),
    (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
         "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "-1"],
     "--wgrad-deferral-limit must be >= 0 (0: every microbatch), got -1"),
])
def test_inconsistent_splits_are_named_in_flags(world, size, argv, message):
    world(size)
    with pytest.raises(ArgumentError) as excinfo:
        validated(*argv)
    assert message in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_deferral_does_not_need_gradient_accumulation_fusion(world):
    # Upstream refuses the flag without the fusion; here the deferred GEMMs add into the
    # gradient themselves (and validate_args turns the fusion off on CPU anyway).
    world(2)
    args = validated("--num-layers", "4", "--pipeline-model-parallel-size", "2",
                     "--defer-embedding-wgrad-compute", "--no-gradient-accumulation-fusion")
    config = core_transformer_config_from_args(args)
    assert config.defer_embedding_wgrad_compute and not config.gradient_accumulation_fusion
