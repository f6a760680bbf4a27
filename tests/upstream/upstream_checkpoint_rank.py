"""One rank of upstream megatron-core 0.11 saving or loading a GPT checkpoint on CPU/gloo (a script).

Started by ``test_checkpoint_interop`` with ``PYTHONPATH`` holding only the unpacked wheel, so
``megatron`` here is upstream's. ``argv[1]`` is a JSON command:

* ``{"action": "save", "tp", "pp", "models", "tokens", "out"}``: for each model (label ->
  shape), build upstream's ``GPTModel`` (local spec) at tp x pp, save it as upstream's legacy
  torch format (``out/LABEL/torch``, the per-rank files Megatron-LM's training loop writes)
  and as ``torch_dist`` (``out/LABEL/torch_dist``, through
  ``megatron.core.dist_checkpointing.save``), and write the logits on ``tokens``;
* ``{"action": "load", "tp", "pp", "models", "tokens", "load", "out", ["optimizer"]}``: build
  each model at tp x pp, read the ``torch_dist`` iteration directory ``load/LABEL`` with
  ``dist_checkpointing.load`` into ``model.sharded_state_dict()`` (with ``optimizer``: and
  into upstream's plain optimizer, see ``load_with_optimizer``), and write the logits.
* ``{"action": "train_save", "tp", "pp", "distributed_optimizer", ["bf16",] "models", "tokens",
  "out"}``: build each model at tp x pp (data-parallel over the other ranks; bf16 as
  Megatron-LM's Float16Module makes it, with fp32 main parameters), wrap it in upstream's DDP,
  take ``STEPS`` Adam steps with upstream's optimizer and pipeline schedule on ``tokens``, and
  save model, ``optimizer.sharded_state_dict`` and scheduler as Megatron-LM's training loop
  does (``out/LABEL/torch_dist``), and the same state in the legacy torch format as
  Megatron-LM's ``--ckpt-format torch`` writes it (``out/LABEL/torch``: per rank the model, the
  optimizer's ``state_dict()``, the scheduler and the RNG states; the distributed optimizer's
  parameter state in ``distrib_optim.pt`` beside it); rank 0 also writes
  ``out/LABEL/optimizer_state.pt``: every
  optimizer state tensor whole under upstream's sharded key, assembled from the ranks'
  in-memory pieces (not from the checkpoint), and the step count.

* ``{"action": "load_legacy", "tp", "pp", "distributed_optimizer", ["bf16",] "models",
  "load", "out"}``: read each model's legacy torch files ``load/LABEL/torch`` (this tree's
  ``--ckpt-format torch``) as Megatron-LM's ``load_checkpoint`` does, strictly, into upstream's
  model, optimizer, scheduler and rerun state machine, and save them again as Megatron-LM does
  (``out/LABEL/torch``), for a comparison of what went in with what came out.

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
STEPS = 3
LR = 0.01


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


def name_cpu_tensors_as_cuda() -> None:
    """Upstream's optimizers sort parameters by ``tensor.type()`` names ('torch.cuda.FloatTensor'
    and the like) and reject others; on this machine CPU tensors answer with those names."""
    type_of = torch.Tensor.type

    def cuda_name(self, dtype=None, *args, **kwargs):
        if dtype is not None:
            return type_of(self, dtype, *args, **kwargs)
        name = type_of(self)
        return name if self.is_cuda else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_name


def keep_step_out_of_distributed_state() -> None:
    """With apex or TE (upstream's GPU set-up) Adam keeps its step per parameter group, and the
    distributed optimizer's per-parameter state holds exp_avg and exp_avg_sq only. torch's
    AdamW, upstream's fallback here, adds a per-parameter 0-d step that 0.11's
    fully_sharded_model_space cannot flatten, and that its legacy load has no value for; leave
    it out of both, as apex's state has none (its state_dict puts the step into every parameter
    group either way)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    states_of = DistributedOptimizer._get_main_param_and_optimizer_states

    def without_step(self, model_param):
        return {k: v for k, v in states_of(self, model_param).items() if k != "step"}

    DistributedOptimizer._get_main_param_and_optimizer_states = without_step
    sets = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_without_step(self, model_param, tensors):
        optim_state = self.optimizer.state[self.optimizer.param_groups[
            self.model_param_group_index_map[model_param][0]]["params"][
            self.model_param_group_index_map[model_param][1]]]
        step = optim_state.pop("step", None)
        try:
            sets(self, model_param, tensors)
        finally:
            if step is not None:
                optim_state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = set_without_step


def restore_numpy_product() -> None:
    """0.11's check of flattened (distributed optimizer) shards calls ``np.product``, which
    numpy 2 removed in favour of ``np.prod``."""
    import numpy

    if not hasattr(numpy, "product"):
        numpy.product = numpy.prod


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


def build_model(spec: dict, pre_process: bool, post_process: bool, parallel_output: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = dict(spec["config"])
    if shape.pop("swiglu", False):
        shape.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                     bias_activation_fusion=False)
    dtype = torch.bfloat16 if spec.get("bf16") else torch.float32
    config = TransformerConfig(**shape, use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, pipeline_dtype=dtype,
                               params_dtype=dtype, bf16=bool(spec.get("bf16")),
                               tensor_model_parallel_size=spec["tp"],
                               pipeline_model_parallel_size=spec["pp"])
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=spec["vocab"],
                     max_sequence_length=spec["max_seq"], pre_process=pre_process,
                     post_process=post_process, parallel_output=parallel_output,
                     share_embeddings_and_output_weights=not spec["untie"],
                     position_embedding_type=spec["position_embedding_type"])
    # As Megatron-LM's Float16Module: every parameter in bf16, torch's norms included.
    return model.to(dtype)


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


def train_steps(model, optimizer, scheduler, tokens: torch.Tensor) -> None:
    """``STEPS`` optimizer steps on one micro-batch of ``tokens`` (next-token labels) through
    upstream's pipeline schedule, as Megatron-LM's train_step runs them."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    labels = torch.roll(tokens, -1, dims=1)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        return chunk(batch, positions, None, labels=labels), loss_func

    for _ in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]),
                                    model=[model], num_microbatches=1,
                                    seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
                                    forward_only=False)
        succeeded, _, _ = optimizer.step()
        assert succeeded
        scheduler.step(increment=1)


def build_optimizer(model, distributed_optimizer: bool):
    """Upstream's DDP wrapper, optimizer (torch AdamW without apex or TE; fp32 main parameters
    apart from a bf16 model's) and scheduler."""
    from megatron.core.distributed import (
        DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    wrapped = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR / 10, weight_decay=0.1,
                        adam_beta2=0.95, clip_grad=0.0,  # clipping asserts CUDA grads
                        bf16=model.config.bf16, params_dtype=model.config.params_dtype,
                        use_distributed_optimizer=distributed_optimizer), [wrapped])
    model.config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=LR / 10, lr_warmup_steps=1,
        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=10, wd_incr_style="constant")
    return wrapped, optimizer, scheduler


def optimizer_pieces(model, optimizer) -> list[tuple]:
    """This rank's saved pieces of optimizer state: (key, global shape, offset, chunk shape,
    flattened range or None, values), factories (SwiGLU's fc1) applied."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor, apply_factories, is_main_replica,
    )

    state = optimizer.sharded_state_dict(model.sharded_state_dict())
    apply_factories(state)
    pieces = []
    for item in nested_values(state):
        if not (isinstance(item, ShardedTensor) and item.key.startswith("optimizer.state.")
                and is_main_replica(item.replica_id)):
            continue
        flat = item.flattened_range
        pieces.append((item.key, tuple(item.global_shape), tuple(item.global_offset),
                       (1,) * item.prepend_axis_num + tuple(item.local_shape),
                       None if flat is None else (flat.start, flat.stop),
                       item.data.detach().float().clone().numpy()))
    return pieces


def assemble(pieces: list[tuple]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's pieces; NaN marks what no piece covered."""
    wholes: dict[str, torch.Tensor] = {}
    for key, shape, offset, chunk, flat, values in pieces:
        whole = wholes.setdefault(key, torch.full(shape, float("nan")))
        region = whole[tuple(slice(o, o + c) for o, c in zip(offset, chunk))]
        values = torch.from_numpy(values)
        if flat is None:
            region.copy_(values.view(region.shape))
        else:
            chunk_values = region.reshape(-1).clone()
            chunk_values[flat[0]:flat[1]] = values
            region.copy_(chunk_values.view(region.shape))
    return wholes


def save_legacy_torch(model, optimizer, scheduler, args, out: Path, command: dict) -> None:
    """What Megatron-LM's ``save_checkpoint`` writes with ``--ckpt-format torch``: one
    ``model_optim_rng.pt`` per tensor- and pipeline-parallel rank, from data-parallel rank 0;
    the distributed optimizer's per-parameter state goes to ``distrib_optim.pt`` beside it."""
    import random

    import numpy

    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    folder = out / "torch" / f"iter_{ITERATION:07d}" / (
        f"mp_rank_{tp_rank:02d}" if command["pp"] == 1
        else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
    if command["distributed_optimizer"]:
        # Collective over the data-parallel group; its first rank writes the file.
        folder.mkdir(parents=True, exist_ok=True)
        optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))
    if parallel_state.get_data_parallel_rank() != 0:
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng_state = [{"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
                  "torch_rng_state": torch.get_rng_state()}]
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                "model": model.state_dict_for_save_checkpoint(),
                "optimizer": optimizer.state_dict(),
                "opt_param_scheduler": scheduler.state_dict(), "rng_state": rng_state,
                "num_floating_point_operations_so_far": 0}, folder / "model_optim_rng.pt")


def train_and_save(model, spec: dict, out: Path, command: dict) -> None:
    """Train a few steps, save as Megatron-LM's loop does, dump the state for comparison."""
    from megatron.core import dist_checkpointing

    distributed_optimizer = command["distributed_optimizer"]
    wrapped, optimizer, scheduler = build_optimizer(model, distributed_optimizer)
    train_steps(wrapped, optimizer, scheduler, torch.tensor(command["tokens"]))
    args = argparse.Namespace(**spec["args"], tensor_model_parallel_size=command["tp"],
                              pipeline_model_parallel_size=command["pp"],
                              data_parallel_size=dist.get_world_size() // (command["tp"]
                                                                           * command["pp"]),
                              use_distributed_optimizer=distributed_optimizer,
                              consumed_train_samples=96)
    dist_dir = out / "torch_dist" / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        dist_dir.mkdir(parents=True, exist_ok=True)
        for root in ("torch", "torch_dist"):
            (out / root).mkdir(parents=True, exist_ok=True)
            (out / root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    save_legacy_torch(model, optimizer, scheduler, args, out, command)
    model_state = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_state,
                             "optimizer": optimizer.sharded_state_dict(model_state),
                             "opt_param_scheduler": scheduler.state_dict(), "args": args,
                             "checkpoint_version": 3.0, "iteration": ITERATION}, str(dist_dir))
    everyone: list = [None] * dist.get_world_size()
    steps = {float(state["step"]) for state in optimizer.optimizer.state.values()}
    dist.all_gather_object(everyone, (optimizer_pieces(model, optimizer), steps))
    if dist.get_rank() == 0:
        all_steps = set().union(*(s for _, s in everyone))
        assert len(all_steps) == 1, all_steps
        torch.save({"tensors": assemble([p for pieces, _ in everyone for p in pieces]),
                    "step": all_steps.pop(), "scheduler": scheduler.state_dict(),
                    "lr": optimizer.param_groups[0]["lr"]},
                   out / "optimizer_state.pt")


def load_with_optimizer(model, directory: Path, out: Path) -> None:
    """As Megatron-LM's ``load_checkpoint`` with the plain optimizer: model and
    ``optimizer.sharded_state_dict(..., is_loading=True)`` through ``dist_checkpointing.load``,
    then ``optimizer.load_state_dict``; writes ``out/optimizer_loaded.pt``: each parameter's
    exp_avg and exp_avg_sq by name, the steps and the groups' wd_mult."""
    from megatron.core import dist_checkpointing

    _, optimizer, _ = build_optimizer(model, distributed_optimizer=False)
    model_state = model.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": model_state,
         "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True)},
        str(directory))
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    assert loaded["checkpoint_version"] == 3.0 and loaded["iteration"] > 0, loaded
    state = optimizer.optimizer.state
    torch.save({"state": {name: {kind: state[param][kind].detach().clone()
                                 for kind in ("exp_avg", "exp_avg_sq")}
                          for name, param in model.named_parameters()},
                "steps": sorted({float(s["step"]) for s in state.values()}),
                "wd_mults": sorted(group["wd_mult"] for group in optimizer.param_groups)},
               out / "optimizer_loaded.pt")


def load_legacy_and_save_again(model, spec: dict, out: Path, command: dict) -> None:
    """As Megatron-LM's ``load_checkpoint`` reads ``--ckpt-format torch`` files (the ones this
    tree wrote, ``load/LABEL``): its checks of the saved args, a strict ``load_state_dict`` of
    the model, the optimizer's ``load_state_dict`` (and the distributed optimizer's
    ``load_parameter_state``), the scheduler, the rerun state machine and the RNG states; then
    saves again as Megatron-LM does (``out/LABEL/torch``)."""
    import random

    import numpy

    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    wrapped, optimizer, scheduler = build_optimizer(model, command["distributed_optimizer"])
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    folder = Path(command["load"]) / out.name / "torch" / f"iter_{ITERATION:07d}" / (
        f"mp_rank_{tp_rank:02d}" if command["pp"] == 1
        else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
    state = torch.load(folder / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    saved_args = state["args"]
    expected = {**spec["args"], "tensor_model_parallel_size": command["tp"],
                "pipeline_model_parallel_size": command["pp"]}
    for name in ("num_layers", "hidden_size", "num_attention_heads",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size"):
        assert getattr(saved_args, name) == expected[name], name
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == ITERATION
    model.load_state_dict(state["model"], strict=True)
    optimizer.load_state_dict(state["optimizer"])
    if command["distributed_optimizer"]:
        # Without no_grad 0.11 fails on fp32 models: its fp32 main shards are views of the
        # parameters, which an in-place copy may not change with autograd on (its training
        # loop does not disable it either: a resume it cannot do itself).
        with torch.no_grad():
            optimizer.load_parameter_state(str(folder / "distrib_optim.pt"))
    scheduler.load_state_dict(state["opt_param_scheduler"])
    get_rerun_state_machine().load_state_dict(state["rerun_state_machine"])
    rng = state["rng_state"][0]
    random.setstate(rng["random_rng_state"])
    numpy.random.set_state(rng["np_rng_state"])
    torch.set_rng_state(rng["torch_rng_state"])
    # A CPU run saves no CUDA generator state (upstream on a GPU then asks for --no-load-rng).
    assert rng["rng_tracker_states"] and ("cuda_rng_state" in rng) == torch.cuda.is_available()
    args = argparse.Namespace(**vars(saved_args))
    save_legacy_torch(model, optimizer, scheduler, args, out, command)


def main() -> None:
    command = json.loads(sys.argv[1])
    install_cpu_shims()
    stand_in_psutil()
    name_cpu_tensors_as_cuda()
    check_megatron_is_upstream()
    adapt_checkpoint_writer()
    keep_step_out_of_distributed_state()
    restore_numpy_product()
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
        training = command["action"] in ("train_save", "load_legacy")
        # Training as Megatron-LM does, with vocabulary-parallel logits (gathering them at tp 1
        # hands the loss a view it may not change in place); full logits otherwise.
        model = build_model({**spec, "tp": tp, "pp": pp, "bf16": command.get("bf16", False)},
                            parallel_state.is_pipeline_first_stage(),
                            parallel_state.is_pipeline_last_stage(), parallel_output=training)
        if command["action"] == "load_legacy":
            load_legacy_and_save_again(model, spec, out, command)
            continue
        if training:
            train_and_save(model, spec, out, command)
            continue
        if command["action"] == "save":
            save_both_formats(model, spec, out, tp, pp)
        else:
            # As Megatron-LM's training loop asks: the model under "model", common.pt beside it.
            if command.get("optimizer"):
                load_with_optimizer(model, Path(command["load"]) / label, out)
            else:
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
