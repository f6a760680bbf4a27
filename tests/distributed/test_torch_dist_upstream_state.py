"""``--ckpt-format torch_dist`` saves hold what Megatron-LM core_v0.11.0 writes, and resume here.

On CPU/gloo with torchrun: a save at pp 2 holds the sharded objects ``rng_state`` and
``rerun_state_machine_state`` under megatron-core's keys (``<name>/shard_<pp>.<tp>_<PP>.<TP>``,
one per (pp, tp) rank), upstream's per-rank RNG layout and the disabled rerun machine's
state, and ``common.pt`` with args (a Namespace), checkpoint_version 3.0, the iteration and
``num_floating_point_operations_so_far``; resumed at the same layout with the default dropout
(so the RNG states matter) it gives the uninterrupted run's losses bit for bit; at another
layout it says, as upstream does, that the RNG state is ignored. With
``--use-distributed-optimizer`` the optimizer state is upstream's ``fully_sharded_model_space``
(N-D flattened keys, fp32 main parameters, ``mcore_data``, the step in every parameter group);
it resumes bit for bit at its layout and, within the cross-layout tolerance, at pp 2 with the
plain optimizer.
"""

import argparse

import pytest

from megatron.core.dist_checkpointing.strategies import dcp_save
from megatron.core.rerun_state_machine import RerunMode, RerunState
from megatron.training.checkpoint import integrity
from megatron.training.flops import num_floating_point_operations
from tests.distributed.test_resume import CROSS_LAYOUT_TOLERANCE
from tests.distributed.test_trainer import data, losses, run, small_gpt  # noqa: F401
from tests.upstream import torch_dist_contents as contents

LAYOUTS = {"pp2": ["--pipeline-model-parallel-size", "2"],
           "tp2": ["--tensor-model-parallel-size", "2"],
           "dp2-distributed-optimizer": ["--use-distributed-optimizer"]}
TORCH_DIST = ["--ckpt-format", "torch_dist"]
RNG_KEYS = {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"}
RERUN_KEYS = {"mode", "state", "current_iteration", "rerun_requested", "checkpoint_requested",
              "restart_again_requested", "continue_requested", "error_injector_checkpoint",
              "failed_validation_call", "initial_result", "suspicious_node", "suspicious_device",
              "data_iterator_checkpoints", "last_loss"}


def _run(data, layout: str, iterations: int, *extra, dropout: bool = False) -> str:
    args = small_gpt(data, "--num-layers", "4", "--train-iters", str(iterations),
                     *LAYOUTS[layout], *extra)
    if dropout:  # drop small_gpt's "--hidden-dropout 0 --attention-dropout 0": defaults (0.1)
        at = args.index("--hidden-dropout")
        del args[at:at + 4]
    return run(2, args)


def _train(data, layout: str, iterations: int, *extra, dropout: bool = False) -> dict:
    return losses(_run(data, layout, iterations, *extra, dropout=dropout))


def _save_and_resume(data, tmp_path, layout: str, *extra, dropout: bool):
    uninterrupted = _train(data, layout, 8, "--save", str(tmp_path), "--save-interval", "4",
                           *TORCH_DIST, *extra, dropout=dropout)
    resumed = _train(data, layout, 8, "--load", str(tmp_path), "--ckpt-step", "4", *extra,
                     dropout=dropout)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert resumed == {i: uninterrupted[i] for i in resumed}
    return uninterrupted, tmp_path / "iter_0000004"


def test_rng_and_rerun_states_are_upstreams_sharded_objects_and_resume(data, tmp_path):
    _, saved = _save_and_resume(data, tmp_path, "pp2", dropout=True)
    keys = contents.object_keys(saved)
    for name in ("rng_state", "rerun_state_machine_state"):
        assert {k for k in keys if k.startswith(name + "/")} == {
            f"{name}/shard_0.0_2.1", f"{name}/shard_1.0_2.1"}
    for stage in (0, 1):
        rngs = contents.read_object(saved, f"rng_state/shard_{stage}.0_2.1")
        assert isinstance(rngs, list) and len(rngs) == 1 and set(rngs[0]) == RNG_KEYS
        assert set(rngs[0]["rng_tracker_states"]) == {
            "data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
        rerun = contents.read_object(saved, f"rerun_state_machine_state/shard_{stage}.0_2.1")
        assert set(rerun) == RERUN_KEYS
        assert (rerun["mode"], rerun["state"]) == (RerunMode.DISABLED, RerunState.NOT_RUNNING_YET)
    # Each stage has its own seed (upstream's seed + 100 * pipeline rank).
    first, second = (contents.read_object(saved, f"rng_state/shard_{s}.0_2.1")[0]
                     for s in (0, 1))
    assert not first["torch_rng_state"].equal(second["torch_rng_state"])
    common = contents.common(saved)
    assert isinstance(common["args"], argparse.Namespace)
    assert (common["checkpoint_version"], common["iteration"]) == (3.0, 4)
    consumed = 4 * 8
    assert common["args"].consumed_train_samples == consumed
    assert common["num_floating_point_operations_so_far"] == pytest.approx(
        num_floating_point_operations(common["args"], consumed))


def test_another_layout_ignores_the_rng_state_as_upstream_says(data, tmp_path):
    _train(data, "pp2", 6, "--save", str(tmp_path), "--exit-interval", "4", *TORCH_DIST)
    output = _run(data, "tp2", 6, "--load", str(tmp_path))
    assert ("(TP, PP, encoder TP, encoder PP) mismatch after resume ((2, 1, 0, 0) vs "
            "(1, 2, 0, 0) from checkpoint): RNG state will be ignored") in output


def test_distributed_optimizer_state_is_upstreams_fully_sharded_model_space(data, tmp_path):
    uninterrupted, saved = _save_and_resume(data, tmp_path, "dp2-distributed-optimizer",
                                            dropout=False)
    shapes = contents.tensor_shapes(saved)
    qkv = "decoder.layers.self_attention.linear_qkv.weight"
    layers, rows, columns = shapes[qkv]
    for kind in ("exp_avg", "exp_avg_sq", "fp32_param"):
        assert shapes[f"optimizer.state.{kind}.{qkv}"] == (layers, 1, 1, rows * columns)
        assert shapes[f"optimizer.state.{kind}.embedding.word_embeddings.weight"] == (
            1, 1, shapes["embedding.word_embeddings.weight"][0] * 64)
    assert not any(key.startswith("optimizer.state.step.") for key in shapes)
    described = contents.metadata(saved).mcore_data
    assert described[f"optimizer.state.exp_avg.{qkv}"] == {
        "nd_reformulated_orig_global_shape": (layers, rows, columns)}
    common = contents.common(saved)
    assert common["args"].ckpt_fully_parallel_save is True
    optimizer = common["optimizer"]
    assert optimizer["param_state_sharding_type"] == "fully_sharded_model_space"
    assert {group["step"] for group in optimizer["optimizer"]["param_groups"]} == {4.0}
    # The plain optimizer at another layout reads the flattened state, also without the
    # shapes mcore_data records (upstream 0.11 saving under torch 2.11 loses them).
    stripped = contents.metadata(saved)
    del stripped.mcore_data
    dcp_save.write_metadata(str(saved), stripped)
    integrity.write_manifest(str(saved))
    other = _train(data, "pp2", 8, "--load", str(tmp_path), "--ckpt-step", "4")
    assert sorted(other) == [5, 6, 7, 8]
    for iteration, value in other.items():
        assert value == pytest.approx(uninterrupted[iteration], rel=CROSS_LAYOUT_TOLERANCE)
