"""Upstream Megatron-LM's initial GPT weights for a command line, on one CPU rank (a script).

Started by ``test_init_parity`` with ``PYTHONPATH`` holding only an upstream checkout
(``MEGATRON_LM_TREE``: ``megatron/`` and ``pretrain_gpt.py`` of core_v0.11.0) and a folder of
the few pip packages its argument parser imports, so ``megatron`` here is upstream's.
``argv[1]`` is a JSON command ``{"argv": [...], "out": "file.pt"}``; the script saves every
tensor of the model's state dict under upstream's names (``_extra_state`` entries left out).

What runs is upstream's own start-up and model provider in their order: ``initialize_megatron``
(argument parsing, validation, tokenizer, padded vocabulary), the model-parallel groups,
``_set_random_seed`` and ``pretrain_gpt.model_provider``. Two shims, in this process only:

* upstream creates the model-parallel groups only when it sees a CUDA device, so here they are
  created by calling its ``initialize_model_parallel`` directly over a one-rank gloo group;
  with no CUDA device its ``_set_random_seed`` seeds python, numpy and torch's CPU generator
  and skips the tracker, which the CPU initialisation never draws from;
* ``--init-method-xavier-uniform``: upstream's config builder passes the output projections'
  initialiser under a name its ``TransformerConfig`` lacks and stops with a TypeError; the
  config is built without the flag and given Xavier-uniform for both initialisers, as meant;
* ``--use-legacy-models``: upstream's legacy LayerNorm imports apex's CUDA extension when it is
  built and normalises through apex; here the import finds an empty stand-in and the
  normalisation is torch's ``layer_norm``, the function apex's kernel computes; its attention
  takes a scratch buffer on ``torch.cuda.current_device()``, which here names the CPU, and
  forks the model-parallel CUDA generator around its dropout, a no-op here (evaluation mode,
  no dropout drawn).

With ``"tokens"`` in the command (a list of token rows), the script also saves the model's
logits on them (causal mask, positions 0..s-1) under ``"logits"``; with ``--save DIR`` in the
command line, upstream's ``save_checkpoint`` writes the model at iteration 3 to DIR first (as
Megatron-LM's training loop does; add ``--no-save-optim --no-save-rng``: there is neither an
optimizer nor a CUDA generator here; upstream reads the CUDA generator's state even so, and
gets an empty stand-in).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from upstream_rank import check_megatron_is_upstream


def give_xavier_to_both_initialisers(pretrain_gpt) -> None:
    """The second shim of the module docstring."""
    build = pretrain_gpt.core_transformer_config_from_args

    def build_with_xavier(args, config_class=None):
        if not args.init_method_xavier_uniform:
            return build(args, config_class)
        args.init_method_xavier_uniform = False
        try:
            config = build(args, config_class)
        finally:
            args.init_method_xavier_uniform = True
        config.init_method = config.output_layer_init_method = torch.nn.init.xavier_uniform_
        return config

    pretrain_gpt.core_transformer_config_from_args = build_with_xavier


def normalise_legacy_layer_norm_with_torch() -> None:
    """The third shim of the module docstring."""
    import types

    import torch.nn.functional as F

    sys.modules.setdefault("fused_layer_norm_cuda", types.ModuleType("fused_layer_norm_cuda"))
    from megatron.legacy.model import fused_layer_norm

    fused_layer_norm.fused_layer_norm_affine = (
        lambda input_, weight, bias, shape, eps: F.layer_norm(input_, shape, weight, bias, eps))
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def logits_of(model, tokens: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor(tokens)
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)[None, None]
    model.eval()
    with torch.no_grad():
        return model(ids, positions, causal).float()


def initial_state(argv: list[str], tokens=None) -> dict[str, torch.Tensor]:
    tree = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0])
    sys.path.insert(0, str(tree))  # pretrain_gpt.py sits at the checkout's root
    sys.argv = ["pretrain_gpt.py", *argv]
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training import get_args
    from megatron.training.initialize import _set_random_seed, initialize_megatron

    give_xavier_to_both_initialisers(pretrain_gpt)
    if "--use-legacy-models" in argv:
        normalise_legacy_layer_norm_with_torch()
    initialize_megatron(allow_no_cuda=True, skip_mpu_initialization=True)
    args = get_args()
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    _set_random_seed(args.seed, args.data_parallel_random_init, args.te_rng_tracker,
                     args.inference_rng_tracker)
    from megatron.core.enums import ModelType

    args.model_type = ModelType.encoder_or_decoder  # set by upstream's pretrain() before this
    model = pretrain_gpt.model_provider(pre_process=True, post_process=True)
    if args.save:
        from megatron.training.checkpointing import save_checkpoint

        torch.cuda.get_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
        save_checkpoint(3, [model], None, None, 0)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()
             if not name.endswith("_extra_state")}
    if tokens is not None:
        state["logits"] = logits_of(model, tokens)
    return state


def main() -> None:
    command = json.loads(sys.argv[1])
    warnings.simplefilter("ignore")  # upstream warns about every optional package it lacks
    check_megatron_is_upstream()
    state = initial_state(command["argv"], command.get("tokens"))
    torch.save(state, command["out"])


if __name__ == "__main__":
    main()
