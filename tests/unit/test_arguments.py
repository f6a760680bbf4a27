"""Command-line arguments: upstream flag names, typed configs, errors that name the flags."""

import pytest

from megatron.training.arguments import (
    ArgumentError, DistributedArgs, ParallelismArgs, agreement_items, config_from_args,
    parse_args, validate_args,
)


@pytest.fixture
def world(monkeypatch):
    def set_world(size, rank=0):
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("RANK", str(rank))
    return set_world


def parsed(*argv):
    return parse_args(argv=["--distributed-backend", "gloo", *argv])


def test_defaults_match_upstream(world):
    world(1)
    args = validate_args(parsed())
    assert args.tensor_model_parallel_size == 1 and args.pipeline_model_parallel_size == 1
    assert args.distributed_timeout_minutes == 10 and args.seed == 1234
    assert args.virtual_pipeline_model_parallel_size is None
    assert args.data_parallel_size == 1 and args.world_size == 1 and args.rank == 0
    assert parse_args(argv=[]).distributed_backend == "nccl"


def test_typed_configs_round_trip(world):
    world(4)
    args = validate_args(parsed("--pipeline-model-parallel-size", "2", "--sequence-parallel",
                                "--tensor-model-parallel-size", "2"))
    parallel = config_from_args(args, ParallelismArgs)
    assert parallel == ParallelismArgs(tensor_model_parallel_size=2,
                                       pipeline_model_parallel_size=2, sequence_parallel=True)
    assert config_from_args(args, DistributedArgs).distributed_backend == "gloo"


@pytest.mark.parametrize("argv,vpp", [
    (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"], 2),
    (["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "4"], None),
    (["--num-virtual-stages-per-pipeline-rank", "3"], 3),
    (["--num-virtual-stages-per-pipeline-rank", "1"], None),
])
def test_virtual_pipeline_size_is_derived_as_upstream(world, argv, vpp):
    world(2)
    args = validate_args(parsed("--pipeline-model-parallel-size", "2", *argv))
    assert args.virtual_pipeline_model_parallel_size == vpp


@pytest.mark.parametrize("size,argv,message", [
    (3, ["--tensor-model-parallel-size", "2"],
     "world size (3 ranks, $WORLD_SIZE) is not divisible by --tensor-model-parallel-size 2"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "8",
         "--num-layers-per-virtual-pipeline-stage", "2", "--num-virtual-stages-per-pipeline-rank",
         "2"], "are alternatives"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     "needs --num-layers"),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers", "6",
         "--num-layers-per-virtual-pipeline-stage", "2"], "must split evenly"),
    (1, ["--num-virtual-stages-per-pipeline-rank", "2"],
     "needs --pipeline-model-parallel-size >= 2"),
    (1, ["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1"),
    (1, ["--distributed-startup-timeout-seconds", "0"], "must be positive"),
])
def test_inconsistent_flags_are_named(world, size, argv, message):
    world(size)
    with pytest.raises(ArgumentError, match=message.replace("$", r"\$").replace("(", r"\(")
                       .replace(")", r"\)")):
        validate_args(parsed(*argv))


def test_nccl_without_cuda_points_to_gloo(world, monkeypatch):
    world(1)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ArgumentError, match="--distributed-backend gloo"):
        validate_args(parse_args(argv=[]))


def test_sequence_parallel_is_dropped_without_tensor_parallelism(world):
    world(1)
    assert validate_args(parsed("--sequence-parallel")).sequence_parallel is False


def test_unknown_flags_are_refused_unless_asked(capsys):
    with pytest.raises(SystemExit):
        parse_args(argv=["--no-such-flag"])
    assert "--no-such-flag" in capsys.readouterr().err
    assert parse_args(argv=["--no-such-flag"], ignore_unknown_args=True).seed == 1234


def test_extra_args_provider_and_defaults(world):
    world(1)

    def extra(parser):
        parser.add_argument("--my-flag", type=int, default=None)
        return parser

    args = validate_args(parse_args(extra, argv=["--distributed-backend", "gloo"]),
                         defaults={"my_flag": 7})
    assert args.my_flag == 7


def test_agreement_items_leave_out_per_rank_values(world):
    world(2, rank=1)
    names = [name for name, _ in agreement_items(validate_args(parsed("--local-rank", "1")))]
    assert "rank" not in names and "local_rank" not in names
    assert names.index("tensor_model_parallel_size") < names.index("seed")
    assert "world_size" in names
