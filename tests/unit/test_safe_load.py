"""Loading a checkpoint cannot run code: every kind of file a reader unpickles, crafted to run a
command when unpickled, ends with one line naming the file and the type, and the command never
runs (a marker file it would create stays absent). Upstream's real content loads: the
arguments' Namespace with dtypes and enums, numpy and python RNG states, the rerun state
machine's enums and call records, Transformer Engine's serialised extra state.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import random
import sys

import numpy as np
import pytest
import torch

from megatron.core.dist_checkpointing import safe_load
from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.strategies import dcp_chunks
from megatron.core.enums import ModelType
from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine
from megatron.core.transformer.enums import AttnBackend
from megatron.training.checkpoint import legacy_convert, sharded_objects
from megatron.training.checkpoint.formats import open_checkpoint
from megatron.training.checkpoint.legacy_convert import WholeOptimizer
from megatron.training.checkpoint.source import optimizer_key

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import checkpoint_convert  # noqa: E402

ARGS = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 16,
        "untie_embeddings_and_output_weights": True, "data_parallel_size": 1}


class RunsCommand:
    """Unpickling it runs ``touch <marker>`` (what a crafted checkpoint would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def model_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    tensors = {"embedding.word_embeddings.weight": torch.randn(16, 8, generator=gen),
               "decoder.final_layernorm.weight": torch.randn(8, generator=gen),
               "output_layer.weight": torch.randn(16, 8, generator=gen)}
    for layer in range(2):
        prefix = f"decoder.layers.{layer}."
        tensors.update({prefix + "input_layernorm.weight": torch.randn(8, generator=gen),
                        prefix + "mlp.linear_fc1.weight": torch.randn(16, 8, generator=gen),
                        prefix + "mlp.linear_fc2.weight": torch.randn(8, 16, generator=gen)})
    return tensors


def legacy_checkpoint(root, distributed: bool = False) -> str:
    tensors = model_tensors()
    optimizer = WholeOptimizer({optimizer_key(kind, name): torch.rand_like(tensor)
                                for name, tensor in tensors.items()
                                for kind in ("exp_avg", "exp_avg_sq")}, step=3.0,
                               settings=[{"wd_mult": w, "lr_mult": 1.0, "lr": 0.1,
                                          "betas": (0.9, 0.95), "eps": 1e-8,
                                          "weight_decay": 0.1 * w} for w in (1.0, 0.0)])
    path = os.path.join(root, "iter_0000003")
    legacy_convert.write(path, tensors, tp=1, pp=2, vpp=None, args=ARGS, iteration=3,
                         scheduler_state={"num_steps": 24}, optimizer=optimizer,
                         data_parallel_size=2 if distributed else None)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    return path


def plant(file: str, marker: str, keep: bool = True) -> None:
    """Put the payload into ``file``: beside its content (``keep``) or as all of it."""
    content = torch.load(file, weights_only=False) if keep else {}
    if not isinstance(content, dict):
        content = {"content": content}
    torch.save({**content, "extra": RunsCommand(marker)}, file)


def assert_refused(error: Exception, file: str, marker: str) -> None:
    text = str(error)
    assert "\n" not in text and file in text and "system" in text, text
    assert "nothing in it was run" in text
    assert not os.path.exists(marker)


def test_upstream_content_loads(tmp_path):
    args = argparse.Namespace(params_dtype=torch.bfloat16, attention_backend=AttnBackend.auto,
                              model_type=ModelType.encoder_or_decoder, data_path=["a"])
    state = {"args": args,
             "rng": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                      "torch_rng_state": torch.get_rng_state()}],
             "rerun": get_rerun_state_machine().state_dict(),
             "te_extra_state": io.BytesIO(b"fp8 meta"), "scalar": np.float64(0.5)}
    torch.save(state, tmp_path / "state.pt")
    loaded = safe_load.load(str(tmp_path / "state.pt"), mmap=True)
    assert loaded["args"] == state["args"] and loaded["rerun"]["mode"] is RerunMode.DISABLED
    assert np.array_equal(loaded["rng"][0]["np_rng_state"][1], state["rng"][0]["np_rng_state"][1])
    assert loaded["te_extra_state"].getvalue() == b"fp8 meta"


def test_upstream_call_records_load_as_this_tree_s():
    """The rerun state of a run that re-ran an iteration holds a Call and a Caller, which
    upstream pickles under the module path they have here."""
    import megatron.core.rerun_state_machine as rerun

    buffer = io.BytesIO()
    torch.save({"failed_validation_call": rerun.Call(rerun.Caller("f.py", 7, 1), 2)}, buffer)
    loaded = safe_load.load_bytes(buffer.getvalue(), "rerun state")["failed_validation_call"]
    assert loaded == rerun.Call(rerun.Caller("f.py", 7, 1), 2)
    assert isinstance(loaded, rerun.Call) and isinstance(loaded.caller, rerun.Caller)


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy-pickle"])
def test_a_payload_is_refused_in_either_torch_save_format(tmp_path, zip_format):
    file, marker = str(tmp_path / "file.pt"), str(tmp_path / "marker")
    torch.save({"args": RunsCommand(marker)}, file, _use_new_zipfile_serialization=zip_format)
    with pytest.raises(safe_load.UnsafeCheckpoint) as raised:
        safe_load.load(file, mmap=True)
    assert_refused(raised.value, file, marker)


def test_a_damaged_file_is_unreadable_not_unsafe(tmp_path):
    file = tmp_path / "file.pt"
    file.write_bytes(bytes(range(256)) * 3)
    with pytest.raises(CheckpointError) as raised:
        safe_load.load(str(file))
    assert not isinstance(raised.value, safe_load.UnsafeCheckpoint)
    assert f"{file} is unreadable" in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("distributed", [False, True])
def test_crafted_legacy_files_are_refused(tmp_path, distributed):
    path = legacy_checkpoint(tmp_path / "ckpt", distributed)
    name = "distrib_optim.pt" if distributed else "model_optim_rng.pt"
    file = os.path.join(path, "mp_rank_00_001", name)
    marker = str(tmp_path / "marker")
    plant(file, marker)
    with pytest.raises(CheckpointError) as raised:
        open_checkpoint(path)
    assert_refused(raised.value, file, marker)


@pytest.mark.parametrize("output_format,file", [
    ("torch_dist", "common.pt"), ("layout_free", "common.pt"), ("torch_dist", ".metadata"),
    ("layout_free", "model/.metadata"), ("layout_free", "optimizer/.metadata")])
def test_crafted_files_of_the_other_formats_are_refused(tmp_path, output_format, file):
    source = legacy_checkpoint(tmp_path / "legacy")
    assert checkpoint_convert.main(["--input", source, "--output", str(tmp_path / "out"),
                                    "--output-format", output_format]) == 0
    path = tmp_path / "out" / "iter_0000003"
    marker = str(tmp_path / "marker")
    target = str(path / file)
    if file.endswith(".metadata"):
        with open(target, "wb") as f:
            pickle.dump(RunsCommand(marker), f)
    else:
        plant(target, marker)
    with pytest.raises(CheckpointError) as raised:
        source = open_checkpoint(str(path))
        source.read_optimizer(source.optimizer_shapes())
    assert_refused(raised.value, target, marker)


def test_crafted_object_in_a_distributed_checkpoint_is_refused(tmp_path):
    marker = str(tmp_path / "marker")
    dcp_chunks.save({"rng_state/shard_0.0_1.1": [RunsCommand(marker)]}, str(tmp_path / "dcp"))
    state = {"rng_state/shard_0.0_1.1": None}
    dcp_chunks.load(state, str(tmp_path / "dcp"))  # the object's bytes, not unpickled
    where = f"{tmp_path / 'dcp'} rng_state/shard_0.0_1.1"
    with pytest.raises(CheckpointError) as raised:
        sharded_objects.decode(state["rng_state/shard_0.0_1.1"], where)
    assert_refused(raised.value, where, marker)


def test_the_converter_refuses_in_one_line(tmp_path, capsys):
    path = legacy_checkpoint(tmp_path / "ckpt")
    file = os.path.join(path, "mp_rank_00_000", "model_optim_rng.pt")
    marker = str(tmp_path / "marker")
    plant(file, marker)
    assert checkpoint_convert.main(["--input", str(tmp_path / "ckpt"), "--output",
                                    str(tmp_path / "out"), "--output-format", "torch_dist"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("checkpoint_convert: ") and file in lines[-1]
    assert not os.path.exists(marker) and not (tmp_path / "out").exists()
