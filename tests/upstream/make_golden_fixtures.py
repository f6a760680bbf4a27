"""Write the golden fixtures: small checkpoints saved by real Megatron-LM core_v0.11.0 on one GPU,
with the losses upstream gets when it resumes each (``tests/upstream/test_golden_fixtures.py``
resumes them here on CPU and must get the same).

    MEGATRON_LM_TREE=<core_v0.11.0 checkout> python -m tests.upstream.make_golden_fixtures DIR \
        [--tar FILE]

``DIR/golden/`` (and, with ``--tar``, the same folder as a .tar.gz) then holds:

* ``corpus_text_document.bin/.idx``: the corpus both trees train on (``tiny_corpus``);
* ``<format>-<optimizer>/``: a checkpoint root (tracker and ``iter_0000004``) saved by upstream's
  ``pretrain_gpt.py`` at iteration 4 of 8, for ``torch_dist`` and ``torch`` with the plain
  optimizer at pp 2 and the distributed optimizer at dp 2 (two ranks sharing the GPU);
* ``golden.json``: the flags, each fixture's layout and optimizer, the losses of upstream's save
  run (iterations 1-4), of its resume of the fixture at the same layout (5-8) and of its run
  through all 8 iterations without a stop (the truth a resume must give: upstream 0.11's own
  resume departs from it with the distributed optimizer under torch's Adam), versions.

A 2-layer model of hidden size 32 (vocabulary 128, sequence 32) keeps the four under ~1.5 MB.
Copy ``DIR/golden`` to ``tests/data/upstream_core_v0_11/golden``. ``MEGATRON_LM_PACKAGES``: a
folder with the packages upstream imports where this interpreter lacks them (``upstream_tree``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.upstream.real_upstream import (
    LAYOUTS, OPTIMIZERS, SAVE_AT, UPSTREAM, Model, Runner, build_dataset_helpers,
    prepare_upstream,
)
from tests.upstream.tiny_corpus import NAME, write_tiny_corpus

MODEL = Model(hidden=32, heads=4, seq=32, ffn=64)
# (format, optimizer) -> the layout upstream saves and resumes at.
FIXTURES = {("torch_dist", "plain"): "pp2", ("torch_dist", "distributed"): "dp2",
            ("torch", "plain"): "pp2", ("torch", "distributed"): "dp2"}


def fixture_name(fmt: str, optimizer: str) -> str:
    return f"{fmt}-{optimizer}"


def _run_all(runner: Runner, work: Path) -> dict[str, dict]:
    """Every fixture saved, then resumed, by upstream, side by side, and upstream's run
    without a stop at each fixture's layout and optimizer."""
    def uninterrupted(key):
        name = fixture_name(*key)
        return runner.train(UPSTREAM, LAYOUTS[FIXTURES[key]], OPTIMIZERS[key[1]],
                            work / f"{name}-uninterrupted")

    def save(key):
        name = fixture_name(*key)
        return runner.save(UPSTREAM, *key, LAYOUTS[FIXTURES[key]], work / name)

    def resume(key):
        name = fixture_name(*key)
        return runner.resume(UPSTREAM, *key, LAYOUTS[FIXTURES[key]],
                             work / name / "checkpoint", work / f"{name}-resumed")

    keys = list(FIXTURES)
    with ThreadPoolExecutor(2 * len(keys)) as pool:
        straight = pool.map(uninterrupted, keys)
        saved = dict(zip(keys, pool.map(save, keys)))
        resumed = dict(zip(keys, pool.map(resume, keys)))
        straight = dict(zip(keys, straight))
    return {fixture_name(*key): {"format": key[0], "optimizer": key[1],
                                 "layout": FIXTURES[key], "saved_at": SAVE_AT,
                                 "save_losses": saved[key], "resume_losses": resumed[key],
                                 "uninterrupted_losses": straight[key]}
            for key in keys}


def _versions() -> dict[str, str]:
    import numpy
    import torch

    return {"upstream": "core_v0.11.0", "torch": torch.__version__, "numpy": numpy.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--tar", type=Path, help="also write DIR/golden as this .tar.gz")
    options = parser.parse_args(argv)
    tree = os.environ.get("MEGATRON_LM_TREE")
    if not tree or not (Path(tree) / "pretrain_gpt.py").is_file():
        parser.error("set MEGATRON_LM_TREE to a Megatron-LM core_v0.11.0 checkout")
    packages = [Path(os.environ["MEGATRON_LM_PACKAGES"])] if os.environ.get(
        "MEGATRON_LM_PACKAGES") else []
    golden, work = options.output / "golden", options.output / "work"
    for folder in (golden, work):  # what an earlier run here left
        shutil.rmtree(folder, ignore_errors=True)
    corpus = write_tiny_corpus(golden)
    copy = prepare_upstream(Path(tree), work / "upstream")
    build_dataset_helpers(copy, packages)
    runner = Runner(copy, packages, corpus, MODEL)
    fixtures = _run_all(runner, work)
    for name in fixtures:
        shutil.copytree(work / name / "checkpoint", golden / name)
    record = {"model_flags": MODEL.flags(), "corpus": NAME,
              "layouts": {name: LAYOUTS[f["layout"]].flags for name, f in fixtures.items()},
              "optimizer_flags": OPTIMIZERS, "fixtures": fixtures, "versions": _versions()}
    (golden / "golden.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    size = sum(f.stat().st_size for f in golden.rglob("*") if f.is_file())
    print(f"wrote {golden}: {len(fixtures)} checkpoints, {size / 1e6:.2f} MB in all")
    for name, fixture in fixtures.items():
        print(f"  {name} at {fixture['layout']}: resumed {fixture['resume_losses']}, "
              f"uninterrupted {fixture['uninterrupted_losses']}")
    if options.tar:
        with tarfile.open(options.tar, "w:gz") as archive:
            archive.add(golden, arcname="golden")
        print(f"wrote {options.tar}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
