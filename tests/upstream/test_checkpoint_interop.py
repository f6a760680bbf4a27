"""Checkpoints interoperate with upstream megatron-core 0.11, both ways, on upstream's own code.

Upstream's ``GPTModel`` (local spec) is built at tp 2 x pp 2 on CPU/gloo ranks that see only the
wheel (``upstream_checkpoint_rank.py``) and saved in its legacy ``torch`` format and as
``torch_dist``; this tree loads both at pp 1 and at pp 4 and must give upstream's logits on the
same tokens. Then this tree saves ``torch_dist`` at tp 2 x pp 2 and upstream's
``dist_checkpointing.load`` reads it at tp 1, again with the same logits, and its plain
optimizer's ``sharded_state_dict(..., is_loading=True)`` + ``load_state_dict`` take our
optimizer state (exp_avg, exp_avg_sq bit for bit, the step, the parameter groups). Two model shapes:
Llama-like (RMSNorm, SwiGLU, rope, grouped-query attention, untied output, no biases) and
GPT-2-like (LayerNorm, GeLU, learned positions, biases, tied output).

Optimizer state: upstream trains each model a few Adam steps with its plain optimizers at
tp 2 x pp 2 (fp32, and bf16 with fp32 main parameters) and with its distributed optimizer at
tp 2 x dp 2, and saves as Megatron-LM does, as ``torch_dist`` and in the legacy ``torch``
format; ``--load`` here (fp32, pp 1 with the plain optimizer, pp 2 x dp 2 with the distributed
one) of every ``torch_dist`` save and of every legacy save (the distributed optimizer's with its
``distrib_optim.pt``) must restore upstream's exp_avg, exp_avg_sq, fp32 main parameters, step
and scheduler exactly, and ``pretrain_gpt.py --load`` of such a checkpoint trains on.

Upstream's code comes from a Megatron-LM core_v0.11.0 checkout named by ``MEGATRON_LM_TREE``, or
from ``MEGATRON_CORE_WHEELS`` (a folder holding megatron_core-0.11.0-*.whl), or from the package
registry; without any the tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.upstream_names import (
    LAYER_PREFIX, layer_name, split_layer, to_local,
)
from tests.launcher import run_ranks
from tests.upstream.upstream_harness import (
    HarnessError,
    run_with_deadline,
    unpack_wheel,
    upstream_environment,
)

pytestmark = pytest.mark.upstream

RANK_SCRIPT = Path(__file__).with_name("upstream_checkpoint_rank.py")
WHEEL = "megatron_core-0.11.0-*.whl"
DEADLINE_S = 150.0
# Both sides compute in fp32; only summation order differs (measured: below 1e-6).
RTOL = 1e-5
TOKENS = [[1, 5, 9, 3, 7, 2, 8, 4, 100, 127], [6, 0, 11, 12, 3, 3, 9, 1, 64, 33]]
# Upstream's optimizer runs (4 ranks each): the plain optimizers at tp 2 x pp 2 (FP32, and
# bf16 with fp32 main parameters), the distributed one at tp 2 x dp 2. The settings match
# upstream_checkpoint_rank.py's.
UPSTREAM_OPTIMIZERS = {
    "plain": {"tp": 2, "pp": 2, "distributed_optimizer": False},
    "plain-bf16": {"tp": 2, "pp": 2, "distributed_optimizer": False, "bf16": True},
    "distributed": {"tp": 2, "pp": 1, "distributed_optimizer": True},
}
LR, STEPS = 0.01, 3
OUR_STEP = 5  # the step count of this tree's saved optimizer state

MODELS = {
    "llama": {
        "seed": 3, "vocab": 128, "max_seq": 16, "untie": True, "position_embedding_type": "rope",
        "config": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                   "num_query_groups": 2, "ffn_hidden_size": 96, "normalization": "RMSNorm",
                   "add_bias_linear": False, "swiglu": True, "init_method_std": 0.2},
        "args": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                 "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 96,
                 "normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False,
                 "untie_embeddings_and_output_weights": True, "position_embedding_type": "rope",
                 "max_position_embeddings": 16},
    },
    "gpt": {
        "seed": 5, "vocab": 128, "max_seq": 16, "untie": False,
        "position_embedding_type": "learned_absolute",
        "config": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                   "ffn_hidden_size": 128, "normalization": "LayerNorm", "add_bias_linear": True,
                   "swiglu": False, "init_method_std": 0.2},
        "args": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                 "group_query_attention": False, "num_query_groups": 1, "ffn_hidden_size": 128,
                 "normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True,
                 "untie_embeddings_and_output_weights": False,
                 "position_embedding_type": "learned_absolute", "max_position_embeddings": 16},
    },
}


@pytest.fixture(scope="module")
def upstream_site(tmp_path_factory) -> Path:
    tree = os.environ.get("MEGATRON_LM_TREE")
    if tree and (Path(tree) / "megatron" / "core").is_dir():
        return Path(tree)  # a Megatron-LM checkout: its megatron.core is the wheel's code
    folder = os.environ.get("MEGATRON_CORE_WHEELS")
    wheels = sorted(Path(folder).glob(WHEEL)) if folder else []
    root = tmp_path_factory.mktemp("megatron-core-0.11.0")
    if not wheels:
        download = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--ignore-requires-python", "--disable-pip-version-check", "-d", str(root / "wheel"),
             "megatron-core==0.11.0"], capture_output=True, text=True, timeout=300)
        wheels = sorted((root / "wheel").glob(WHEEL))
        if not wheels:
            pytest.skip("megatron-core 0.11.0: set MEGATRON_CORE_WHEELS to a folder with its "
                        f"wheel (pip download failed: {download.stderr.strip()[-200:]})")
    try:
        return unpack_wheel(wheels[-1], root / "site")
    except HarnessError as error:
        pytest.fail(str(error))


def run_upstream(site: Path, world: int, command: dict) -> None:
    """``upstream_checkpoint_rank.py`` on ``world`` gloo ranks; fails with the logs' tails."""
    out = Path(command["out"])
    out.mkdir(parents=True, exist_ok=True)
    env = upstream_environment([site], world)
    logs = [out / f"rank{rank}.log" for rank in range(world)]
    codes = run_with_deadline([sys.executable, str(RANK_SCRIPT), json.dumps(command)],
                              [{**env, "RANK": str(rank)} for rank in range(world)], logs,
                              give_up_at=time.monotonic() + DEADLINE_S)
    if codes != [0] * world:
        tails = "\n".join(f"rank {r}: " + "\n".join(log.read_text().splitlines()[-15:])
                          for r, log in enumerate(logs))
        pytest.fail(f"upstream {command['action']} failed, exit codes {codes}:\n{tails}")


def our_model(spec: dict, tp: int, pp: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from tests.support.gpt_support import small_config

    shape = dict(spec["config"])
    if shape.pop("swiglu"):
        shape.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                     bias_activation_fusion=False)
    config = small_config(**shape, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          pipeline_dtype=torch.float32)
    torch.manual_seed(spec["seed"] + 100)  # other weights than upstream's, until loaded
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=spec["vocab"],
                    max_sequence_length=spec["max_seq"],
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(), parallel_output=False,
                    share_embeddings_and_output_weights=not spec["untie"],
                    position_embedding_type=spec["position_embedding_type"])


def pipeline_logits(model, tokens: torch.Tensor):
    """Forward by hand through the stages; the last stage's logits, None elsewhere."""
    from megatron.core import parallel_state

    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    model.eval()
    with torch.no_grad():
        if not parallel_state.is_pipeline_first_stage():
            hidden = torch.empty(tokens.shape[1], tokens.shape[0], model.config.hidden_size)
            dist.recv(hidden, parallel_state.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        output = model(tokens, positions, None)
        if not parallel_state.is_pipeline_last_stage():
            dist.send(output.contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
            return None
    return output.float().numpy()  # by value: a tensor would be passed as a shared-memory handle


def load_here(rank: int, world: int, pp: int, checkpoints: dict[str, str]) -> dict:
    """At tp 1 x pp ``pp``: load each (model, format) checkpoint and return the logits."""
    from megatron.core import parallel_state
    from megatron.training.checkpoint.formats import open_checkpoint
    from megatron.training.checkpoint.model_loading import load_model_tensors

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    found = {}
    for label, path in checkpoints.items():
        model = our_model(MODELS[label.split("/")[0]], 1, pp)
        load_model_tensors([model], open_checkpoint(path))
        found[label] = pipeline_logits(model, torch.tensor(TOKENS))
    return found


def load_sharded_here(rank: int, world: int, tp: int, pp: int, checkpoints: dict[str, str]
                      ) -> dict:
    """At tp x pp: read each upstream torch_dist iteration directory through megatron-core's
    API, ``dist_checkpointing.load`` into ``model.sharded_state_dict()``, then
    ``load_state_dict``; the logits."""
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             pipeline_model_parallel_size=pp)
    found = {}
    for label, path in checkpoints.items():
        model = our_model(MODELS[label], tp, pp)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(loaded["model"])
        found[label] = pipeline_logits(model, torch.tensor(TOKENS))
    return found


def save_sharded_here(rank: int, world: int, out: str) -> dict:
    """At tp 2 x pp 2: save each model through megatron-core's API (``dist_checkpointing.save``
    of ``model.sharded_state_dict()`` under "model", as Megatron-LM's loop lays it out); the
    logits."""
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
                                             pipeline_model_parallel_size=2)
    found = {}
    for label, spec in MODELS.items():
        model = our_model(spec, 2, 2)
        directory = os.path.join(out, label)
        os.makedirs(directory, exist_ok=True)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "checkpoint_version": 3.0,
                                 "iteration": 7}, directory)
        found[label] = pipeline_logits(model, torch.tensor(TOKENS))
    return found


def save_here(rank: int, world: int, out: str) -> tuple[dict, dict]:
    """At tp 2 x pp 2: save each model with its plain optimizer (made-up Adam state at step
    OUR_STEP) as torch_dist; the logits, and the optimizer tensors this rank wrote whole."""
    from megatron.core import parallel_state
    from megatron.training.checkpoint.dist_save import save_torch_dist
    from megatron.training.checkpoint.optimizer_state import optimizer_state_to_save

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
                                             pipeline_model_parallel_size=2)
    found, written = {}, {}
    for label, spec in MODELS.items():
        model = our_model(spec, 2, 2)
        wrapped, optimizer, scheduler = optimizer_and_scheduler(model, distributed=False)
        optimizer.init_state_fn(optimizer.optimizer)
        torch.manual_seed(rank)
        for state in optimizer.optimizer.state.values():
            state["exp_avg"].copy_(torch.randn_like(state["exp_avg"]))
            state["exp_avg_sq"].copy_(torch.rand_like(state["exp_avg_sq"]))
            state["step"].fill_(OUR_STEP)
        save_torch_dist([wrapped], os.path.join(out, label), iteration=3, args=spec["args"],
                        consumed_samples=0, scheduler_state=scheduler.state_dict(),
                        optimizer=optimizer)
        # The last stage's tied output layer holds its own (here: other made-up) state for the
        # embeddings; the first stage's is saved.
        written[label] = {key: whole.numpy() for key, whole in
                          optimizer_state_to_save([wrapped], optimizer).items()
                          if parallel_state.is_pipeline_first_stage()
                          or not key.endswith(".embedding.word_embeddings.weight")}
        logits = pipeline_logits(model, torch.tensor(TOKENS))
        found[label] = logits if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    return found, written


def last_stage(results: list[dict]) -> dict[str, torch.Tensor]:
    return {label: torch.from_numpy(logits) for result in results
            for label, logits in result.items() if logits is not None}


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    error = float((actual - expected).abs().max() / expected.abs().max())
    assert error <= RTOL, f"{label}: largest difference {error:.3g} of the largest logit"


@pytest.fixture(scope="module")
def upstream_saved(upstream_site, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("upstream-saved")
    run_upstream(upstream_site, 4, {"action": "save", "tp": 2, "pp": 2, "models": MODELS,
                                    "tokens": TOKENS, "out": str(out)})
    return out


@pytest.mark.parametrize("pp", [1, 4])
def test_upstream_tp2_pp2_checkpoints_load_here(upstream_saved, pp):
    checkpoints = {f"{label}/{fmt}": str(upstream_saved / label / fmt)
                   for label in MODELS for fmt in ("torch", "torch_dist")}
    logits = last_stage(run_ranks(load_here, pp, args=(pp, checkpoints), timeout_s=120))
    assert sorted(logits) == sorted(checkpoints)
    for label, found in logits.items():
        expected = torch.load(upstream_saved / label.split("/")[0] / "logits.pt")
        assert_same_logits(found, expected, f"{label} at pp {pp}")


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_sharded_state_dict_loads_upstreams_torch_dist(upstream_saved, tp, pp):
    checkpoints = {label: str(upstream_saved / label / "torch_dist" / "iter_0000007")
                   for label in MODELS}
    logits = last_stage(run_ranks(load_sharded_here, tp * pp, args=(tp, pp, checkpoints),
                                  timeout_s=120))
    assert sorted(logits) == sorted(MODELS)
    for label, found in logits.items():
        expected = torch.load(upstream_saved / label / "logits.pt")
        assert_same_logits(found, expected, f"{label} at tp {tp} x pp {pp}")


def test_upstream_loads_our_sharded_state_dict_save_at_tp1(upstream_site, tmp_path):
    ours = last_stage(run_ranks(save_sharded_here, 4, args=(str(tmp_path / "ours"),),
                                timeout_s=120))
    out = tmp_path / "upstream"
    run_upstream(upstream_site, 1, {"action": "load", "tp": 1, "pp": 1, "models": MODELS,
                                    "tokens": TOKENS, "load": str(tmp_path / "ours"),
                                    "out": str(out)})
    for label in MODELS:
        assert_same_logits(torch.load(out / label / "logits.pt"), ours[label], label)


def test_upstream_loads_our_tp2_pp2_torch_dist_at_tp1(upstream_site, tmp_path):
    # Weights and, into upstream's plain optimizer, the optimizer state (exp_avg, exp_avg_sq
    # bit for bit, the common step) and the parameter groups.
    results = run_ranks(save_here, 4, args=(str(tmp_path / "ours"),), timeout_s=120)
    ours = last_stage([logits for logits, _ in results])
    out = tmp_path / "upstream"
    run_upstream(upstream_site, 1, {"action": "load", "tp": 1, "pp": 1, "models": MODELS,
                                    "tokens": TOKENS, "load": str(tmp_path / "ours"),
                                    "out": str(out), "optimizer": True})
    for label in MODELS:
        assert_same_logits(torch.load(out / label / "logits.pt"), ours[label], label)
        written = {key: torch.from_numpy(value) for _, by_label in results
                   for key, value in by_label[label].items()}
        loaded = torch.load(out / label / "optimizer_loaded.pt")
        assert loaded["steps"] == [float(OUR_STEP)]
        assert loaded["wd_mults"] == [0.0, 1.0]
        assert len(loaded["state"]) == sum(1 for key in written if ".exp_avg." in key)
        for name, state in loaded["state"].items():
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[kind], written[f"optimizer.state.{kind}.{name}"]), (
                    label, kind, name)


def optimizer_and_scheduler(model, distributed: bool):
    """This tree's DDP wrapper, optimizer and scheduler, set up as upstream's were."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    wrapped = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, min_lr=LR / 10, weight_decay=0.1, adam_beta2=0.95,
                        use_distributed_optimizer=distributed), [wrapped])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=LR / 10, lr_warmup_steps=1, lr_decay_steps=10,
        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=10,
        wd_incr_style="constant")
    return wrapped, optimizer, scheduler


def optimizer_pieces(model, optimizer) -> list[tuple]:
    """(canonical name, flat start, end, {state: values}) of each piece this rank steps."""
    from megatron.training.checkpoint.model_tensors import model_tensors

    pieces = {piece.param: piece for piece in optimizer.main_param_pieces()}
    found = []
    for name, _, param in model_tensors(model):
        piece = pieces.get(param)
        if piece is None:
            continue
        state = optimizer.optimizer.state[piece.main]
        values = {kind: state[kind].detach().reshape(-1).numpy().copy()
                  for kind in ("exp_avg", "exp_avg_sq")}
        values["fp32_param"] = piece.main.detach().reshape(-1).numpy().copy()
        found.append((to_local(name), piece.start, piece.end, values, float(state["step"])))
    return found


def load_optimizer_here(rank: int, world: int, pp: int, distributed: bool,
                        roots: dict[str, str]) -> list[tuple]:
    """At tp 1 x pp ``pp`` (data-parallel over the rest): ``load_checkpoint`` of each upstream
    save root, as ``--load ROOT --dist-ckpt-strictness raise_all`` does (so a tensor of
    upstream's torch_dist saves that this tree leaves unread stops it); this rank's optimizer
    pieces and scheduler after it."""
    import argparse

    from megatron.core import parallel_state
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import set_args

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    found = []
    for label, root in roots.items():
        spec = MODELS[label.split("/")[0]]
        model, optimizer, scheduler = optimizer_and_scheduler(our_model(spec, 1, pp), distributed)
        set_args(argparse.Namespace(**spec["args"], load=root, ckpt_step=None, finetune=False,
                                    no_load_optim=False, ckpt_fully_parallel_load=False,
                                    dist_ckpt_strictness="raise_all"))
        iteration, _ = load_checkpoint([model], optimizer, scheduler)
        found.append((label, iteration, scheduler.num_steps,
                      sorted({group["lr"] for group in optimizer.param_groups}),
                      optimizer_pieces([model], optimizer)))
    return found


def load_sharded_optimizer_here(rank: int, world: int, pp: int, roots: dict[str, str]
                                ) -> list[tuple]:
    """At tp 1 x pp ``pp``: megatron-core's API as Megatron-LM's loop calls it,
    ``dist_checkpointing.load`` of the model's and the plain optimizer's sharded state dicts
    from each upstream ``torch_dist`` save, then both ``load_state_dict``; this rank's pieces."""
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    found = []
    for label, root in roots.items():
        model, optimizer, _ = optimizer_and_scheduler(our_model(MODELS[label], 1, pp), False)
        model_state = model.sharded_state_dict()
        request = {"model": model_state,
                   "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True)}
        loaded = dist_checkpointing.load(request, os.path.join(root, "iter_0000007"))
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        found.append((label, sorted({group["lr"] for group in optimizer.param_groups}),
                      optimizer_pieces([model], optimizer)))
    return found


def canonical_state(upstream_key: str, whole: torch.Tensor) -> dict[tuple[str, str], torch.Tensor]:
    """(state kind, canonical name) -> tensor of one of upstream's optimizer keys, split into
    layers where the key stacks them."""
    kind, _, model_key = upstream_key[len("optimizer.state."):].partition(".")
    if model_key.startswith(LAYER_PREFIX) and split_layer(model_key) is None:
        rest = to_local(model_key)[len(LAYER_PREFIX):]
        return {(kind, layer_name(index, rest)): layer for index, layer in enumerate(whole)}
    return {(kind, to_local(model_key)): whole}


@pytest.fixture(scope="module")
def upstream_trained(upstream_site, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("upstream-trained")
    for kind, layout in UPSTREAM_OPTIMIZERS.items():
        run_upstream(upstream_site, 4, {"action": "train_save", **layout, "models": MODELS,
                                        "tokens": TOKENS, "out": str(out / kind)})
    return out


@pytest.mark.parametrize("pp", [1, 2])
def test_optimizer_sharded_state_dict_loads_upstreams_plain_optimizer(upstream_trained, pp):
    roots = {label: str(upstream_trained / "plain" / label / "torch_dist") for label in MODELS}
    results = run_ranks(load_sharded_optimizer_here, pp, args=(pp, roots), timeout_s=120)
    for label in roots:
        saved = torch.load(upstream_trained / "plain" / label / "optimizer_state.pt")
        expected = {found: value for key, whole in saved["tensors"].items()
                    for found, value in canonical_state(key, whole).items()}
        checked = set()
        for rank_results in results:
            _, lrs, pieces = next(r for r in rank_results if r[0] == label)
            assert lrs == [pytest.approx(saved["lr"], rel=1e-12)], label
            for name, start, end, values, step in pieces:
                assert step == STEPS, (label, name)
                for state in ("exp_avg", "exp_avg_sq"):
                    reference = expected[(state, name)].reshape(-1)[start:end]
                    assert torch.equal(torch.from_numpy(values[state]), reference), (
                        label, state, name)
                    checked.add((state, name))
        assert checked == set(expected), sorted(set(expected) - checked)[:5]


@pytest.mark.parametrize("pp,dp,distributed", [(1, 1, False), (2, 2, True)])
def test_upstream_optimizer_state_loads_here(upstream_trained, pp, dp, distributed):
    # Every save, torch_dist and legacy torch (the distributed optimizer's with distrib_optim.pt).
    roots = {f"{label}/{kind}/{fmt}": str(upstream_trained / kind / label / fmt)
             for kind in UPSTREAM_OPTIMIZERS for label in MODELS
             for fmt in ("torch_dist", "torch")}
    results = run_ranks(load_optimizer_here, pp * dp, args=(pp, distributed, roots),
                        timeout_s=120)
    for label in roots:
        model, kind, _ = label.split("/")
        saved = torch.load(upstream_trained / kind / model / "optimizer_state.pt")
        assert saved["step"] == STEPS
        expected = {found: value for key, whole in saved["tensors"].items()
                    for found, value in canonical_state(key, whole).items()}
        assert not any(value.isnan().any() for value in expected.values())
        checked = set()
        for rank_results in results:
            _, iteration, scheduler_steps, lrs, pieces = next(
                r for r in rank_results if r[0] == label)
            assert iteration == 7 and scheduler_steps == saved["scheduler"]["num_steps"]
            assert lrs == [pytest.approx(saved["lr"], rel=1e-12)], label
            for name, start, end, values, step in pieces:
                assert step == STEPS, (label, name)
                for state, value in values.items():
                    if (state, name) not in expected:
                        assert state == "fp32_param" and kind == "plain"  # fp32: none saved
                        continue
                    reference = expected[(state, name)].reshape(-1)[start:end]
                    # Exact: the same fp32 values, moved and cut.
                    assert torch.equal(torch.from_numpy(value), reference), (label, state, name)
                    checked.add((state, name))
        assert checked == set(expected), sorted(set(expected) - checked)[:5]


@pytest.mark.parametrize("saved,fmt,message", [
    ("upstream_saved", "torch_dist", "holds no optimizer state this tree can read: add "
                                     "--no-load-optim"),
    ("upstream_saved", "torch", "holds no optimizer state (saved with --no-save-optim?): add "
                                "--no-load-optim"),
])
def test_upstream_checkpoint_without_optimizer_state_asks_for_no_load_optim(request, saved, fmt,
                                                                           message):
    import argparse

    from megatron.training.checkpoint.upstream_resume import load_upstream_checkpoint

    args = argparse.Namespace(**MODELS["gpt"]["args"], finetune=False, no_load_optim=False,
                              dist_ckpt_strictness="assume_ok_unexpected")
    root = request.getfixturevalue(saved)
    path = root / "gpt" / fmt / "iter_0000007"
    with pytest.raises(CheckpointError) as raised:
        load_upstream_checkpoint(None, None, None, str(path), args)
    assert message in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize("damage,message", [
    ("swap", "optimizer state exp_avg of parameter"),
    ("drop", "are not those upstream builds from its model"),
])
def test_upstream_legacy_optimizer_state_that_does_not_fit_its_model_asks_for_no_load_optim(
        upstream_trained, tmp_path, damage, message):
    """Parameter numbers that do not map onto the rank's parameters by shape, or groups that are
    not upstream's, never load: one line names the file."""
    import argparse
    import shutil

    from megatron.training.checkpoint.upstream_resume import load_upstream_checkpoint

    path = tmp_path / "iter_0000007"
    shutil.copytree(upstream_trained / "plain" / "gpt" / "torch" / "iter_0000007", path)
    file = path / "mp_rank_00_001" / "model_optim_rng.pt"
    state = torch.load(file, weights_only=False)
    group = next(g for g in state["optimizer"]["param_groups"] if g["wd_mult"] == 1.0)
    if damage == "swap":  # linear_proj.weight and linear_qkv.weight: other shapes
        group["params"][0], group["params"][1] = group["params"][1], group["params"][0]
    else:
        group["params"].pop()
    torch.save(state, file)
    args = argparse.Namespace(**MODELS["gpt"]["args"], finetune=False, no_load_optim=False,
                              dist_ckpt_strictness="assume_ok_unexpected")
    with pytest.raises(CheckpointError) as raised:
        load_upstream_checkpoint(None, None, None, str(path), args)
    text = str(raised.value)
    assert message in text and str(file) in text and "--no-load-optim" in text, text
    assert "\n" not in text


# tests/distributed/test_trainer.py's small_gpt model, as upstream builds it (vocabulary: the
# quickstart tokenizer's 512, already a multiple of 128).
SMALL_GPT = {
    "seed": 11, "vocab": 512, "max_seq": 64, "untie": False,
    "position_embedding_type": "learned_absolute",
    "config": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
               "ffn_hidden_size": 256, "normalization": "LayerNorm", "add_bias_linear": True,
               "swiglu": False, "init_method_std": 0.02},
    "args": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 4,
             "group_query_attention": False, "num_query_groups": 1, "ffn_hidden_size": 256,
             "normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True,
             "untie_embeddings_and_output_weights": False,
             "position_embedding_type": "learned_absolute", "max_position_embeddings": 64},
}


def test_pretrain_resumes_upstream_distributed_optimizer_checkpoint(upstream_site, tmp_path):
    from tests.distributed.test_trainer import losses, run, small_gpt

    out = tmp_path / "upstream"
    run_upstream(upstream_site, 2, {"action": "train_save", "tp": 1, "pp": 1,
                                    "distributed_optimizer": True, "models": {"gpt": SMALL_GPT},
                                    "tokens": TOKENS, "out": str(out)})
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(Path(__file__).parents[2] / "tools" /
                                        "make_quickstart_data.py"), str(data)],
                   check=True, capture_output=True, timeout=120)
    # Saved at iteration 7 by dp 2; resumed at pp 2 for two more iterations, on the saved
    # schedule (the flags here describe another, which upstream too would refuse without it).
    output = run(2, small_gpt(data, "--train-iters", "9", "--pipeline-model-parallel-size", "2",
                              "--load", str(out / "gpt" / "torch_dist"),
                              "--use-checkpoint-opt_param-scheduler"))
    assert "(model weights, optimizer state and scheduler)" in output
    assert sorted(losses(output)) == [8, 9]
