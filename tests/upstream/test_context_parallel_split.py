"""Context parallelism splits as upstream does: for context-parallel sizes 2, 3 and 4 and every
rank, this tree's ``get_batch_on_this_cp_rank`` and rotary embedding give each rank the rows
that real upstream core_v0.11.0's own functions give it (``upstream_cp_split_rank.py``, run in
a process that sees only the checkout named by ``MEGATRON_LM_TREE``; skipped when unset)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.utils import get_batch_on_this_cp_rank
from tests.upstream.upstream_harness import upstream_environment
from tests.upstream.upstream_tree import upstream_python_path

pytestmark = pytest.mark.upstream

SCRIPT = Path(__file__).with_name("upstream_cp_split_rank.py")
SEQ, BATCH, KV_CHANNELS = 48, 2, 16
ROPE_VARIANTS = {"plain": {}, "interleaved": {"rotary_interleaved": True},
                 "interpolated": {"seq_len_interpolation_factor": 3.0},
                 "scaled": {"rope_scaling": True, "rotary_base": 500000}}


def _ours(monkeypatch) -> dict[str, torch.Tensor]:
    results = {}
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    for cp in (2, 3, 4):
        for rank in range(cp):
            monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
            monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: rank)
            tokens = torch.arange(BATCH * SEQ).view(BATCH, SEQ)
            batch = {"tokens": tokens, "labels": tokens + 1, "loss_mask": (tokens % 3).float(),
                     "position_ids": torch.arange(SEQ).expand(BATCH, SEQ),
                     "attention_mask": None}
            for key, value in get_batch_on_this_cp_rank(batch).items():
                if value is not None:
                    results[f"cp{cp} rank{rank} {key}"] = value.cpu()
            for name, options in ROPE_VARIANTS.items():
                rope = RotaryEmbedding(KV_CHANNELS, rotary_percent=1.0, **options)
                results[f"cp{cp} rank{rank} rope {name}"] = rope(SEQ).cpu()
    return results


def test_each_rank_gets_upstream_s_rows(monkeypatch, tmp_path):
    env = upstream_environment(upstream_python_path(tmp_path / "packages"), world_size=1)
    out = tmp_path / "upstream.pt"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    theirs = torch.load(out, weights_only=True)
    ours = _ours(monkeypatch)
    assert sorted(ours) == sorted(theirs)
    differ = [key for key in ours if ours[key].dtype != theirs[key].dtype
              or not torch.equal(ours[key], theirs[key])]
    assert not differ, differ
