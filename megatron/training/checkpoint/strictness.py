"""``--dist-ckpt-strictness``: what a load does about tensors the checkpoint and the run do not
share.

The modes are upstream's ``StrictHandling`` (megatron.core.dist_checkpointing.validation), applied
to the trainer's load of a distributed checkpoint (``torch_dist``, or this tree's layout-free
format; upstream's legacy ``torch`` files are read as before, as upstream's flag covers only
distributed checkpoints). Its words: an *unexpected* key is a tensor this run reads that the
checkpoint lacks; a *missing* key is a tensor the checkpoint holds that no rank reads (weights of
layers this model does not have, or all the optimizer state under ``--no-load-optim`` or
``--finetune``). The tensors compared are the model's weights and, per weight, its optimizer
state; random-number states are restored or skipped as the checkpoint's layout says.

A model cannot start without its weights, so an unexpected weight stops the load in every mode
(upstream loads the model strictly after reading the checkpoint, and stops there); in the
modes that look, every rank stops alike before reading. The modes differ in what is said first
and in what missing keys do:

================================  ===================  ==========================================
mode                              missing keys          unexpected keys
================================  ===================  ==========================================
assume_ok_unexpected, ignore_all  not looked for        the ranks reading one stop at the first
log_unexpected                    not looked for        all logged, then the load stops
log_all                           logged                all logged, then the load stops
raise_unexpected                  not looked for        the load stops naming them
raise_all                         the load stops        the load stops naming them
                                  naming them
================================  ===================  ==========================================

An error names the first 20 keys and counts the rest; a log names them all, as upstream's does.
``return_unexpected`` and ``return_all`` give the keys back to the caller of
``dist_checkpointing.load``; the trainer's load has no caller to give them to, and the flag check
refuses them.
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.ranks import from_every_rank
from megatron.core.dist_checkpointing.upstream_names import to_local
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.training.checkpoint.model_tensors import model_tensors
from megatron.training.checkpoint.source import CheckpointSource, split_optimizer_key
from megatron.training.utils import print_rank_0

_SILENT = (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.IGNORE_ALL)
_WITH_MISSING = (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL)
_RAISING = (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL)
_NAMED_IN_ERROR = 20


def check_shared_keys(source: CheckpointSource, model, strictness: str,
                      with_optimizer: bool) -> None:
    """Compare the tensors of ``source`` with those this run reads, as ``strictness`` says,
    before anything is read. Collective in every mode that looks: the ranks exchange the weights
    they read, so that all of them log or stop alike."""
    strict = StrictHandling(strictness)
    if strict in _SILENT or source.format == "torch":
        return
    read = set().union(*from_every_rank(sorted(to_local(name) for name, _, _
                                               in model_tensors(model))))
    unexpected = read - set(source.shapes)
    missing: set[str] = set()
    if strict in _WITH_MISSING:
        missing = set(source.shapes) - read
        missing |= {key for key in source.stored_optimizer_keys()
                    if not with_optimizer or split_optimizer_key(key)[1] not in read}
    if not missing and not unexpected:
        return
    if strict in _RAISING:
        raise CheckpointError(f"{_described(source.path, missing, unexpected, _NAMED_IN_ERROR)} "
                              f"(--dist-ckpt-strictness {strict.value})")
    print_rank_0(f"WARNING: {_described(source.path, missing, unexpected, None)}")
    if unexpected:
        raise CheckpointError(f"checkpoint {source.path} lacks {len(unexpected)} weight(s) of "
                              f"this model, logged above: it was saved from another model")


def _described(path: str, missing: set[str], unexpected: set[str], limit) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensor(s) of the checkpoint that no rank reads: "
                     f"{_listed(missing, limit)}")
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) this run reads that the checkpoint lacks: "
                     f"{_listed(unexpected, limit)}")
    return f"checkpoint {path} and this run do not match: " + "; ".join(parts)


def _listed(keys: set[str], limit) -> str:
    names = sorted(keys)
    if limit is None or len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", ... and {len(names) - limit} more"
