"""One rank of upstream megatron-core 0.11 saving or loading a GPT checkpoint on CPU/gloo (a script).

Started by ``test_checkpoint_interop`` with ``PYTHONPATH`` holding only the unpacked wheel, so
``megatron`` here is upstream's. ``argv[1]`` is a JSON command:

* ``{"action": "save", "tp", "pp", "models", "tokens", "out"}``: for each model (label ->
  shape), build upstream's ``GPTModel`` (local spec) at tp x pp, save it as upstream's legacy
  torch format (``out/LABEL/torch``, the per-rank files Megatron-LM's training loop writes)
  and as ``torch_dist`` (``out/LABEL/torch_dist``, through
  ``megatron.core.dist_checkpointing.save``), and write the logits on ``tokens``;
* ``{"action": "load", "tp", "pp", "models", "tokens", "load", "out"}``: build each model at
  tp x pp, read the ``torch_dist`` iteration directory ``load/LABEL`` with
  ``dist_checkpointing.load`` into ``model.sharded_state_dict()``, and write the logits.

The last stage's tensor-parallel rank 0 writes ``out/LABEL/logits.pt`` (full vocabulary, fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import resource
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

from upstream_rank import check_megatron_is_upstream, install_cpu_shims

ITERATION = 7


def stand_in_psutil() -> None:
    """Upstream's checkpoint writer imports psutil only to log its own memory use, and this
    venv has none: a stand-in answers that one question from getrusage."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        def memory_info():
            return types.SimpleNamespace(
                rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

        stand_in = types.ModuleType("psutil")
        stand_in.Process = lambda pid: types.SimpleNamespace(memory_info=memory_info)
        sys.modules["psutil"] = stand_in


def adapt_checkpoint_writer() -> None:
    """megatron-core 0.11's checkpoint writer calls torch's private ``_write_item`` with the
    four arguments of torch 2.4-2.6; newer torch also wants the stream transforms and the
    serialisation format. Hand it torch's defaults for both (what torch's own writer uses)."""
    import inspect

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint import filesystem

    if len(inspect.signature(filesystem._write_item).parameters) == 4:
        return
    write_item = filesystem._write_item
    filesystem_async._write_item = lambda stream, data, item, key: write_item(
        filesystem._StorageWriterTransforms(), stream, data, item, key,
        filesystem.SerializationFormat.TORCH_SAVE)


def build_model(spec: dict, pre_process: bool, post_process: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = dict(spec["config"])
    if shape.pop("swiglu", False):
        shape.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                     bias_activation_fusion=False)
    config = TransformerConfig(**shape, use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, pipeline_dtype=torch.float32,
                               tensor_model_parallel_size=spec["tp"],
                               pipeline_model_parallel_size=spec["pp"])
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=spec["vocab"],
                    max_sequence_length=spec["max_seq"], pre_process=pre_process,
                    post_process=post_process, parallel_output=False,
                    share_embeddings_and_output_weights=not spec["untie"],
                    position_embedding_type=spec["position_embedding_type"])


def logits_of(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """Forward through the pipeline by hand: hidden states go stage to stage with send/recv."""
    from megatron.core import parallel_state

    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    hidden_shape = (tokens.shape[1], tokens.shape[0], model.config.hidden_size)
    with torch.no_grad():
        if not parallel_state.is_pipeline_first_stage():
            received = torch.empty(hidden_shape)
            dist.recv(received, parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(received)
        output = model(tokens, positions, None)
        if not parallel_state.is_pipeline_last_stage():
            dist.send(output.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
            return None
    return output.float()


def save_both_formats(model, spec: dict, out: Path, tp: int, pp: int) -> None:
    """Legacy torch (the per-rank files Megatron-LM's training loop writes) and torch_dist."""
    from megatron.core import dist_checkpointing, parallel_state

    args = argparse.Namespace(**spec["args"], tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp, consumed_train_samples=96)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    folder = out / "torch" / f"iter_{ITERATION:07d}" / (
        f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": model.state_dict_for_save_checkpoint()}, folder / "model_optim_rng.pt")
    dist_dir = out / "torch_dist" / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        dist_dir.mkdir(parents=True, exist_ok=True)
        for root in ("torch", "torch_dist"):
            (out / root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args,
                             "checkpoint_version": 3.0, "iteration": ITERATION}, str(dist_dir))


def main() -> None:
    command = json.loads(sys.argv[1])
    install_cpu_shims()
    stand_in_psutil()
    check_megatron_is_upstream()
    adapt_checkpoint_writer()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    tp, pp = command["tp"], command["pp"]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    # No dropout runs, so the forked CUDA RNG streams (absent on CPU) are never drawn from.
    tp_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    for label, spec in command["models"].items():
        out = Path(command["out"]) / label
        out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(spec["seed"])
        model = build_model({**spec, "tp": tp, "pp": pp},
                            parallel_state.is_pipeline_first_stage(),
                            parallel_state.is_pipeline_last_stage())
        if command["action"] == "save":
            save_both_formats(model, spec, out, tp, pp)
        else:
            # As Megatron-LM's training loop asks: the model under "model", common.pt beside it.
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                             str(Path(command["load"]) / label))
            model.load_state_dict(loaded["model"])
            assert loaded["checkpoint_version"] == 3.0 and loaded["iteration"] > 0, loaded
        model.eval()
        logits = logits_of(model, torch.tensor(command["tokens"]))
        if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            torch.save(logits, out / "logits.pt")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown was seen to block now and then (see upstream_rank.py)


if __name__ == "__main__":
    main()
