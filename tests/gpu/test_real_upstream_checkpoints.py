"""Checkpoints both ways with real Megatron-LM core_v0.11.0 (``pretrain_gpt.py``), on one GPU.

For each direction (upstream saves and this tree resumes; this tree saves and upstream resumes),
format (``torch_dist``, legacy ``torch``), optimizer (plain, ``--use-distributed-optimizer``)
and resume layout (the saving one, another): one tree trains to iteration 4 and saves there
(``--exit-interval 4`` of ``--train-iters 8``), the other tree resumes that checkpoint at the
layout to iteration 8, and its losses of iterations 5-8 must equal those of the saving tree's
run that did not stop (the truth a resume must reproduce). The saving tree's own resume at the
saving layout is held to the same truth: this tree's always; upstream's with the plain
optimizer, while with the distributed optimizer under torch's Adam (no apex or Transformer
Engine, as here) upstream 0.11's own resume departs from its run by 5.6e-3 from the first step
after the resume (measured 2026-12-04, both formats; iteration 5 equal), an upstream defect
recorded as an expected failure; this tree resumes the same checkpoints exactly.

Layouts (several ranks share the GPU as one-GPU hosts): the plain optimizer saves at pp 2, the
distributed one at dp 2; "another" is tp 2 for ``torch_dist`` (which reshapes; the RNG state,
kept per (pp, tp) rank, is then skipped with ``--no-load-rng`` by both trees, as upstream
demands) and another data-parallel size for the legacy format (whose files are per (tp, pp)
rank, so upstream itself resumes them at its saving tp x pp only): pp 2 x dp 2 (plain), dp 1
(distributed).

Tolerance: fp32 throughout, TF32 off; the two trees run different attention, softmax, loss and
Adam code, and other layouts reduce in another order, so equal state gives losses equal to
within rounding (measured: 0 to 7.2e-6). A state that is off (Adam's moments or step, the
scheduler, main parameters) moves the first updated loss by 1e-3 or more, so ``RTOL`` = 2e-5
separates the two by two orders of magnitude.

The runs are shared between cells and pytest-xdist workers (``real_upstream.RunCache``): 8
saves, 4 runs without a stop and 24 resumes, about 5 minutes with ``-n 7`` on one H200 and 16
cores. Needs ``MEGATRON_LM_TREE`` (a core_v0.11.0 checkout; skipped without it) and the packages
of ``upstream_tree``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.gpu.nccl_support import needs
from tests.upstream.real_upstream import (
    LAYOUTS, OPTIMIZERS, OURS, UPSTREAM, Layout, Model, RunCache, Runner, build_dataset_helpers,
    prepare_upstream, relative_difference,
)
from tests.upstream.tiny_corpus import NAME, write_tiny_corpus
from tests.upstream.upstream_tree import upstream_python_path

pytestmark = [*needs("nccl"), pytest.mark.upstream]

RTOL = 2e-5
# (format, optimizer): the saving layout, the same one, another one.
PLAN = {("torch_dist", "plain"): ("pp2", "pp2", "tp2"),
        ("torch_dist", "distributed"): ("dp2", "dp2", "tp2"),
        ("torch", "plain"): ("pp2", "pp2", "pp2dp2"),
        ("torch", "distributed"): ("dp2", "dp2", "dp1")}
# Cells that share a save come far apart, so that parallel workers start on different saves.
SAVES = [(saver, fmt, optimizer) for fmt, optimizer in PLAN for saver in (UPSTREAM, OURS)]
CELLS = [(saver, fmt, optimizer, where) for where in ("same", "another")
         for fmt, optimizer in PLAN for saver in (UPSTREAM, OURS)]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> RunCache:
    """Shared by the session's workers; ``REAL_UPSTREAM_RUNS``: a folder that keeps the runs
    for later sessions on the same machine (e.g. to split the cells over two commands)."""
    kept = os.environ.get("REAL_UPSTREAM_RUNS")
    if kept:
        return RunCache(Path(kept))
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return RunCache(shared / "real-upstream-runs")


@pytest.fixture(scope="session")
def runner(tmp_path_factory, runs) -> Runner:
    tree, *packages = upstream_python_path(tmp_path_factory.getbasetemp() / "upstream-packages")

    def prepare(folder):
        build_dataset_helpers(prepare_upstream(tree, folder), packages)
        write_tiny_corpus(folder / "corpus")

    shared, _ = runs.once("upstream-copy-and-corpus", prepare)
    return Runner(shared, packages, shared / "corpus" / NAME, Model())


def _saved(runs: RunCache, runner: Runner, saver: str, fmt: str, optimizer: str):
    layout = LAYOUTS[PLAN[(fmt, optimizer)][0]]
    folder, _ = runs.get(f"{saver}-saves-{fmt}-{optimizer}-at-{layout.name}",
                         lambda f: runner.save(saver, fmt, optimizer, layout, f))
    return folder / "checkpoint"


def _resume(runs: RunCache, runner: Runner, saver: str, fmt: str, optimizer: str,
            layout: Layout, who: str, no_load_rng: bool = False) -> dict[int, float]:
    checkpoint = _saved(runs, runner, saver, fmt, optimizer)
    name = f"{who}-resumes-{checkpoint.parent.name}-at-{layout.name}"
    return runs.get(name, lambda f: runner.resume(who, fmt, optimizer, layout, checkpoint, f,
                                                  no_load_rng=no_load_rng))[1]


def _uninterrupted(runs: RunCache, runner: Runner, who: str, optimizer: str,
                   layout: Layout) -> dict[int, float]:
    return runs.get(f"{who}-trains-{optimizer}-at-{layout.name}-uninterrupted",
                    lambda f: runner.train(who, layout, OPTIMIZERS[optimizer], f))[1]


def _check(resumed: dict[int, float], straight: dict[int, float], what: str) -> None:
    worst = relative_difference(resumed, {i: straight[i] for i in resumed})
    print(f"{what}: largest relative difference to the run without a stop {worst:.2e}")
    assert worst <= RTOL, f"resumed {resumed}, without a stop {straight}"


UPSTREAM_OWN_RESUME_DEFECT = pytest.mark.xfail(
    strict=True, reason="upstream 0.11 under torch's Adam: its own resume of a distributed-"
    "optimizer checkpoint departs from its run by 5.6e-3 (this tree's resume does not)")


@pytest.mark.parametrize("saver,fmt,optimizer", [
    pytest.param(*save, marks=[UPSTREAM_OWN_RESUME_DEFECT] if save[0] == UPSTREAM
                 and save[2] == "distributed" else []) for save in SAVES],
    ids=[f"{s}-saves-{f}-{o}" for s, f, o in SAVES])
def test_the_saving_trees_own_resume_continues_its_run(saver, fmt, optimizer, runs, runner):
    layout = LAYOUTS[PLAN[(fmt, optimizer)][0]]
    _check(_resume(runs, runner, saver, fmt, optimizer, layout, saver),
           _uninterrupted(runs, runner, saver, optimizer, layout),
           f"{saver}'s own resume of {fmt} ({optimizer} optimizer) at {layout.name}")


@pytest.mark.parametrize("saver,fmt,optimizer,where", CELLS,
                         ids=[f"{s}-saves-{f}-{o}-resumed-at-{w}-layout" for s, f, o, w in CELLS])
def test_the_other_trees_resume_continues_the_saving_trees_run(saver, fmt, optimizer, where,
                                                               runs, runner):
    saved_at, same, another = PLAN[(fmt, optimizer)]
    layout = LAYOUTS[same if where == "same" else another]
    other = OURS if saver == UPSTREAM else UPSTREAM
    resumed = _resume(runs, runner, saver, fmt, optimizer, layout, other,
                      no_load_rng=fmt == "torch_dist" and layout.name != saved_at)
    _check(resumed, _uninterrupted(runs, runner, saver, optimizer, LAYOUTS[saved_at]),
           f"{saver} saved {fmt} ({optimizer} optimizer) at {saved_at}, {other} resumed at "
           f"{layout.name}")
