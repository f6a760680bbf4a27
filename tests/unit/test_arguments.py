"""Command-line arguments: upstream flag names, typed configs, errors that name the flags."""

import pytest
import torch

from megatron.training.arguments import (
    ArgumentError, agreement_items, config_from_args, parse_args, validate_args,
)
from megatron.training.flags.groups import DistributedArgs, TrainingArgs
from megatron.training.config_builders import core_transformer_config_from_args


@pytest.fixture
def world(monkeypatch):
    def set_world(size, rank=0):
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("RANK", str(rank))
    return set_world


def parsed(*argv):
    return parse_args(argv=["--distributed-backend", "gloo", "--transformer-impl", "local", *argv])


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
    parallel = config_from_args(args, DistributedArgs)
    # Variable lengths are not bucketed on CPU (gloo); without interleaving parameter
    # all-gathers are not aligned (as upstream); the local rank is $LOCAL_RANK's, else 0.
    assert parallel == DistributedArgs(tensor_model_parallel_size=2,
                                       pipeline_model_parallel_size=2,
                                       distributed_backend="gloo", variable_seq_length_multiple=1,
                                       align_param_gather=False, local_rank=0)
    training = config_from_args(args, TrainingArgs)
    # validate_args turns fused gradient accumulation off on CPU: it is a CUDA GEMM's.
    assert training.sequence_parallel and not training.gradient_accumulation_fusion


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
    (4, ["--expert-tensor-parallel-size", "8"],
     "--expert-tensor-parallel-size 8 x --pipeline-model-parallel-size 1 must divide"),
    (2, ["--context-parallel-size", "2", "--seq-length", "30"],
     "--seq-length 30 must be a multiple of 4 with --context-parallel-size 2"),
    (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
         "--sequence-parallel", "--seq-length", "34"],
     "--seq-length 34 must be a multiple of 4 with --context-parallel-size 2 and sequence "
     "parallelism"),
    (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "3",
         "--sequence-parallel", "--seq-length", "24"], "not divisible"),
    (2, ["--context-parallel-size", "2", "--seq-length", "32", "--reset-attention-mask"],
     "--reset-attention-mask builds an attention mask per batch"),
    (4, ["--context-parallel-size", "4", "--seq-length", "32", "--cp-comm-type", "a2a+p2p"],
     "--cp-comm-type a2a\\+p2p needs --hierarchical-context-parallel-sizes"),
    (4, ["--context-parallel-size", "4", "--seq-length", "32", "--cp-comm-type", "a2a+p2p",
         "--hierarchical-context-parallel-sizes", "2", "3"], "must multiply to"),
    (2, ["--context-parallel-size", "2", "--seq-length", "32", "--cp-comm-type", "ring"],
     "--cp-comm-type ring: one of p2p, all_gather, a2a, a2a"),
    (2, ["--context-parallel-size", "2", "--seq-length", "32", "--num-layers", "3",
         "--cp-comm-type", "p2p", "a2a"], "one value or one per layer"),
    (1, ["--error-injection-rate", "-1", "--rerun-mode", "validate_results"],
     "--error-injection-rate must be >= 0"),
    (1, ["--error-injection-rate", "100"],
     "--error-injection-rate tests the re-runs of --rerun-mode validate_results; with "
     "--rerun-mode disabled it would inject nothing"),
    (4, ["--context-parallel-size", "4", "--seq-length", "32", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "2", "--cp-comm-type", "a2a"],
     "--cp-comm-type a2a splits each tensor-parallel rank's attention heads (8) and key/value "
     "heads (2) over --context-parallel-size 4"),
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
    with pytest.raises(SystemExit) as exited:
        parse_args(argv=["--no-such-flag"])
    lines = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2
    # The error and where to look, not the usage of every flag.
    assert len(lines) == 2 and lines[0].endswith("error: unrecognized arguments: --no-such-flag")
    assert "docs/flags.md" in lines[1] and "tools/check_args.py" in lines[1]
    assert parse_args(argv=["--no-such-flag"], ignore_unknown_args=True).seed == 1234
    with pytest.raises(SystemExit):
        parse_args(argv=["--num-layers", "two"])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].endswith("error: argument --num-layers: invalid int "
                                                 "value: 'two'")


def test_extra_args_provider_and_defaults(world):
    world(1)

    def extra(parser):
        parser.add_argument("--my-flag", type=int, default=None)
        return parser

    args = validate_args(parse_args(extra, argv=["--distributed-backend", "gloo",
                                                 "--transformer-impl", "local"]),
                         defaults={"my_flag": 7})
    assert args.my_flag == 7


def test_agreement_items_leave_out_per_rank_values(world):
    world(2, rank=1)
    names = [name for name, _ in agreement_items(validate_args(parsed("--local-rank", "1")))]
    assert "rank" not in names and "local_rank" not in names
    assert names.index("num_layers") < names.index("seed")
    assert "world_size" in names


def test_upstream_flag_spellings_and_negations(world):
    world(2)
    args = validate_args(parsed("--disable-bias-linear", "--no-overlap-p2p-communication",
                                "--untie-embeddings-and-output-weights", "--swiglu",
                                "--hidden-size", "256", "--num-attention-heads", "8",
                                "--seq-length", "64", "--micro-batch-size", "2",
                                "--data-path", "0.3", "a", "0.7", "b", "--use-mcore-models"))
    assert args.add_bias_linear is False and args.untie_embeddings_and_output_weights
    assert args.overlap_p2p_comm is False and args.batch_p2p_comm is True
    assert args.ffn_hidden_size == 640 and args.kv_channels == 32 and args.num_query_groups == 8
    assert args.max_position_embeddings == 64 and args.global_batch_size == 4
    assert args.data_path == ["0.3", "a", "0.7", "b"]
    defaults = validate_args(parsed())
    assert defaults.overlap_p2p_comm is True and defaults.batch_p2p_comm is False


@pytest.mark.parametrize("argv,message", [
    (["--fp16", "--bf16"], "--fp16 and --bf16 are alternatives"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "5"], "alternatives"),
    (["--save-interval", "5"], "--save-interval needs --save"),
    (["--ckpt-step", "4"], "--ckpt-step 4 needs --load"),
    (["--load", "x", "--ckpt-step", "-1"], "an iteration >= 0"),
    (["--variable-seq-length-multiple", "0"], "--variable-seq-length-multiple must be at least 1"),
    (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer needs --bf16 or --fp16"),
    (["--bf16", "--exp-avg-dtype", "fp16"], "--exp-avg-dtype fp16 needs "
                                             "--use-precision-aware-optimizer"),
    (["--bf16", "--main-params-dtype", "fp16"], "--main-params-dtype fp16 needs "
                                                "--use-precision-aware-optimizer"),
    (["--fp16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16"],
     "--main-grads-dtype bf16 needs --bf16"),
    (["--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
      "--accumulate-allreduce-grads-in-fp32"], "drop --accumulate-allreduce-grads-in-fp32"),
    (["--first-last-layers-bf16"], "--first-last-layers-bf16 needs --fp8-format"),
])
def test_more_inconsistent_flags(world, argv, message):
    world(1)
    with pytest.raises(ArgumentError, match=message):
        validate_args(parsed(*argv))


def test_transformer_engine_without_it_runs_the_local_layers(world, capsys):
    world(1)
    args = validate_args(parse_args(argv=["--distributed-backend", "gloo"]))
    assert args.transformer_impl == "local"
    assert "Transformer Engine is not installed" in capsys.readouterr().out


def test_training_needs_its_flags(world):
    from megatron.training.arguments import validate_training_args

    world(2)
    args = validate_args(parsed())
    with pytest.raises(ArgumentError, match="--num-layers, --hidden-size"):
        validate_training_args(args)
    args = validate_args(parsed("--num-layers", "2", "--hidden-size", "8",
                                "--num-attention-heads", "2", "--seq-length", "16",
                                "--micro-batch-size", "2", "--global-batch-size", "6",
                                "--train-iters", "3", "--lr", "1e-3", "--mock-data",
                                "--vocab-size", "64"))
    with pytest.raises(ArgumentError, match="--global-batch-size 6 is not a multiple"):
        validate_training_args(args)
    training = ("--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "3", "--lr",
                "1e-3", "--mock-data", "--vocab-size", "64")
    args = validate_args(parsed(*training, "--global-batch-size", "8"))
    assert args.eval_global_batch_size == 8  # evaluation's follows the global batch size
    validate_training_args(args)
    args = validate_args(parsed(*training, "--global-batch-size", "8",
                                "--eval-global-batch-size", "6"))
    with pytest.raises(ArgumentError, match="--eval-global-batch-size 6 is not a multiple of "
                                            "--micro-batch-size 2 x data-parallel size 2 = 4"):
        validate_training_args(args)
    # By default evaluation takes the global batch size as the training does, rounded down
    # with --decrease-batch-size-if-needed.
    validate_training_args(validate_args(parsed(*training, "--global-batch-size", "6",
                                                "--decrease-batch-size-if-needed")))


def test_fusion_flags_select_the_fusions_as_upstream(world):
    world(1)
    model = ("--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
             "--seq-length", "4", "--micro-batch-size", "1")

    def config(*flags):
        return core_transformer_config_from_args(validate_args(parsed(*model, *flags)))

    assert config().bias_activation_fusion and config().bias_dropout_fusion
    off = config("--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-masked-softmax-fusion")
    assert not (off.bias_activation_fusion or off.bias_dropout_fusion or off.masked_softmax_fusion)
    assert config("--swiglu", "--no-bias-gelu-fusion").bias_activation_fusion
    assert not config("--swiglu", "--no-bias-swiglu-fusion").bias_activation_fusion
    assert not config().cross_entropy_loss_fusion  # off by default, as upstream
    assert config("--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl",
                  "native").cross_entropy_loss_fusion


def test_variable_lengths_are_bucketed_on_gpus_only(world, monkeypatch):
    world(1)
    assert validate_args(parsed()).variable_seq_length_multiple == 1
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    on_gpus = ["--transformer-impl", "local"]
    assert validate_args(parse_args(argv=on_gpus)).variable_seq_length_multiple == 8
    chosen = parse_args(argv=[*on_gpus, "--variable-seq-length-multiple", "64"])
    assert validate_args(chosen).variable_seq_length_multiple == 64


def test_precision_aware_optimizer_reaches_the_optimizer_config(world):
    from megatron.training.config_builders import optimizer_config_from_args

    world(1)
    args = validate_args(parsed("--bf16", "--use-precision-aware-optimizer"))
    assert optimizer_config_from_args(args).use_precision_aware_optimizer is True
    assert optimizer_config_from_args(validate_args(parsed("--bf16"))) \
        .use_precision_aware_optimizer is False
    low = validate_args(parsed("--fp16", "--use-precision-aware-optimizer", "--exp-avg-dtype",
                               "fp8", "--exp-avg-sq-dtype", "fp16"))
    assert low.accumulate_allreduce_grads_in_fp32  # the flat Adam reads fp32 gradients
    config = optimizer_config_from_args(low)
    assert (config.exp_avg_dtype, config.exp_avg_sq_dtype) == (torch.uint8, torch.float16)
    lean = validate_args(parsed("--bf16", "--use-precision-aware-optimizer", "--main-grads-dtype",
                                "bf16", "--main-params-dtype", "fp16"))
    assert not lean.accumulate_allreduce_grads_in_fp32  # bf16 gradient buffers
    config = optimizer_config_from_args(lean)
    assert (config.main_grads_dtype, config.main_params_dtype) == (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("flags,message", [
    (("--lr-warmup-iters", "3"), r"--lr-warmup-iters 3 must be smaller than the decay "
                                 r"iterations, 3 \(--train-iters, as --lr-decay-iters is unset\)"),
    (("--lr-warmup-iters", "5", "--lr-decay-iters", "4"),
     r"decay iterations, 4 \(--lr-decay-iters\)"),
    (("--lr-warmup-fraction", "1.0"), r"--lr-warmup-fraction must be in \[0, 1\), got 1.0"),
    (("--lr-decay-iters", "0"), "--lr-decay-iters must be >= 1, got 0"),
    (("--min-lr", "2e-3"), r"need 0 <= --min-lr \(0.002\) <= --lr \(0.001\)"),
])
def test_learning_rate_schedule_is_checked_in_flag_names(world, flags, message):
    from megatron.training.arguments import validate_training_args

    world(1)
    args = validate_args(parsed("--num-layers", "2", "--hidden-size", "8",
                                "--num-attention-heads", "2", "--seq-length", "16",
                                "--micro-batch-size", "2", "--train-iters", "3", "--lr", "1e-3",
                                "--mock-data", "--vocab-size", "64", *flags))
    with pytest.raises(ArgumentError, match=message):
        validate_training_args(args)


def test_fp8_flags_reach_the_transformer_config(world, monkeypatch, capsys):
    pytest.importorskip("torchao.float8")
    world(1)
    args = validate_args(parsed("--num-layers", "4", "--hidden-size", "32",
                                "--num-attention-heads", "2", "--seq-length", "8",
                                "--micro-batch-size", "1",
                                "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise",
                                "--no-fp8-wgrad", "--first-last-layers-bf16",
                                "--fp8-amax-history-len", "16"))
    assert "--fp8-amax-history-len tune delayed scaling (--fp8-recipe delayed" in \
        capsys.readouterr().out
    config = core_transformer_config_from_args(args)
    assert (config.fp8, config.fp8_recipe, config.fp8_wgrad, config.first_last_layers_bf16) == \
        ("hybrid", "rowwise", False, True)
    delayed = validate_args(parsed("--num-layers", "4", "--hidden-size", "32",
                                   "--num-attention-heads", "2", "--seq-length", "8",
                                   "--micro-batch-size", "1", "--bf16", "--fp8-format", "hybrid",
                                   "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
                                   "--fp8-amax-compute-algo", "max", "--fp8-margin", "1"))
    assert "WARNING" not in capsys.readouterr().out
    config = core_transformer_config_from_args(delayed)
    assert (config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo,
            config.fp8_margin) == ("delayed", 16, "max", 1)
    with pytest.raises(ArgumentError, match="--fp8-amax-history-len must be at least 1, got 0"):
        validate_args(parsed("--num-layers", "4", "--hidden-size", "32",
                             "--num-attention-heads", "2", "--seq-length", "8",
                             "--micro-batch-size", "1", "--bf16", "--fp8-format", "hybrid",
                             "--fp8-recipe", "delayed", "--fp8-amax-history-len", "0"))
    monkeypatch.setattr("megatron.core.transformer.te_backend.transformer_engine_available",
                        lambda: True)
    te_fp8 = validate_args(parse_args(argv=["--distributed-backend", "gloo", "--fp8-format",
                                            "e4m3"]))  # TE's own fp8 path: no torchao asked
    assert (te_fp8.transformer_impl, te_fp8.fp8) == ("transformer_engine", "e4m3")
    with pytest.raises(ArgumentError, match="--fp8-recipe rowwise is torchao's"):
        validate_args(parse_args(argv=["--distributed-backend", "gloo", "--fp8-format", "e4m3",
                                       "--fp8-recipe", "rowwise"]))
    monkeypatch.undo()
    world(1)
    monkeypatch.setitem(__import__("sys").modules, "torchao.float8", None)
    with pytest.raises(ArgumentError, match=r"--fp8-format e4m3: FP8 training without "
                                            r"Transformer Engine needs torchao"):
        validate_args(parsed("--bf16", "--fp8-format", "e4m3"))
