"""File and sample compatibility with upstream megatron-core 0.11.0, both ways.

The wheel is downloaded once per session (``pip download --no-deps``) and unpacked into a
temporary directory. Upstream's package is also called ``megatron``, so its code only ever runs
in a subprocess whose PYTHONPATH holds that directory; this process imports ours. The two sides
exchange data through ``.npz`` files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy
import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.training.tokenizer import NullTokenizer

pytestmark = pytest.mark.upstream

UPSTREAM = "megatron-core==0.11.0"
_OFFLINE_SIGNS = ("NewConnectionError", "Failed to establish a new connection",
                  "Temporary failure in name resolution", "Network is unreachable",
                  "ConnectTimeoutError", "Connection refused", "ProxyError", "No route to host")

# Runs inside the subprocess; argv[1] is a JSON command.
UPSTREAM_SIDE = textwrap.dedent('''
    import json, sys
    import numpy, torch
    import megatron
    command = json.loads(sys.argv[1])
    if not all(path.startswith(command["site"]) for path in megatron.__path__):
        sys.exit(f"imported megatron from {list(megatron.__path__)}, not the upstream wheel")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    if command["action"] == "read":
        dataset = IndexedDataset(command["prefix"])
        tokens = [dataset[i] for i in range(len(dataset))]
        numpy.savez(command["out"], tokens=numpy.concatenate(tokens) if tokens else [],
                    lengths=dataset.sequence_lengths, documents=dataset.document_indices,
                    dtype=numpy.dtype(dataset.index.dtype).name)

    elif command["action"] == "write":
        spec = numpy.load(command["spec"])
        builder = IndexedDatasetBuilder(command["prefix"] + ".bin",
                                        dtype=getattr(numpy, str(spec["dtype"])))
        sequences = numpy.split(spec["tokens"], numpy.cumsum(spec["lengths"])[:-1])
        boundaries = set(spec["documents"].tolist())
        for number, sequence in enumerate(sequences, start=1):
            builder.add_item(torch.from_numpy(sequence))
            if number in boundaries:
                builder.end_document()
        builder.finalize(command["prefix"] + ".idx")

    elif command["action"] == "gpt":
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder)
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer

        class Tokenizer(MegatronTokenizer):
            def __init__(self):
                super().__init__("none", vocab_size=command["vocab"])
            def tokenize(self, text):
                return []
            vocab = property(lambda self: {})
            inv_vocab = property(lambda self: {})
            vocab_size = property(lambda self: command["vocab"])
            eod = property(lambda self: command["vocab"] - 1)

        config = GPTDatasetConfig(
            random_seed=command["seed"], sequence_length=command["sequence_length"],
            blend=([command["prefix"]], None), split=command["split"], tokenizer=Tokenizer(),
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
            path_to_cache=command["cache"])
        splits = BlendedMegatronDatasetBuilder(
            GPTDataset, command["sizes"], lambda: True, config).build()
        arrays = {}
        for name, dataset in zip(("train", "valid", "test"), splits):
            arrays[name + "_document_index"] = dataset.document_index
            arrays[name + "_sample_index"] = dataset.sample_index
            arrays[name + "_shuffle_index"] = dataset.shuffle_index
            arrays[name + "_tokens"] = numpy.stack(
                [dataset[i]["tokens"].numpy() for i in range(min(20, len(dataset)))])
        numpy.savez(command["out"], **arrays)
''')


@pytest.fixture(scope="session")
def upstream_site(tmp_path_factory) -> Path:
    """megatron-core 0.11.0 unpacked; downloaded once per test session."""
    root = tmp_path_factory.mktemp("megatron-core-0.11.0")
    download = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-d", str(root / "wheel"), UPSTREAM],
        capture_output=True, text=True, timeout=300)
    if download.returncode != 0:
        output = download.stdout + download.stderr
        if any(sign in output for sign in _OFFLINE_SIGNS):
            pytest.skip(f"the package registry is unreachable, cannot download {UPSTREAM}: "
                        f"{output.strip().splitlines()[-1]}")
        pytest.fail(f"pip download {UPSTREAM} failed:\n{output}")
    wheel = next((root / "wheel").glob("megatron_core-*.whl"))
    site = root / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def run_upstream(site: Path, workdir: Path, **command) -> None:
    command["site"] = str(site)
    result = subprocess.run(
        # -P: the working directory is not put on sys.path, so only PYTHONPATH's megatron counts.
        [sys.executable, "-P", "-c", UPSTREAM_SIDE, json.dumps(command)],
        cwd=workdir, env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(f"upstream side failed ({command['action']}):\n{result.stderr}")


def sample_documents(seed: int, count: int, high: int,
                     fewest_sequences: int) -> list[list[list[int]]]:
    """Documents of ``fewest_sequences`` to 2 sequences of 1 to 39 tokens each."""
    rng = numpy.random.default_rng(seed)
    return [[rng.integers(0, high, size=int(rng.integers(1, 40))).tolist()
             for _ in range(int(rng.integers(fewest_sequences, 3)))] for _ in range(count)]


def write_ours(prefix: str, documents, dtype) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(torch.tensor(sequence))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype, high", [(numpy.uint16, 65000), (numpy.int32, 200000)])
def test_upstream_reads_what_we_write(upstream_site, tmp_path, dtype, high):
    documents = sample_documents(1, 60, high, fewest_sequences=0)
    prefix = str(tmp_path / "ours")
    write_ours(prefix, documents, dtype)
    run_upstream(upstream_site, tmp_path, action="read", prefix=prefix,
                 out=str(tmp_path / "read.npz"))
    theirs = numpy.load(tmp_path / "read.npz")
    ours = IndexedDataset(prefix)
    expected = [token for document in documents for sequence in document for token in sequence]
    assert theirs["tokens"].tolist() == expected
    assert str(theirs["dtype"]) == numpy.dtype(dtype).name
    assert numpy.array_equal(theirs["lengths"], ours.sequence_lengths)
    assert numpy.array_equal(theirs["documents"], ours.document_indices)


@pytest.mark.parametrize("dtype, high", [(numpy.uint16, 65000), (numpy.int32, 200000)])
def test_we_read_what_upstream_writes_and_write_the_same_bytes(upstream_site, tmp_path, dtype,
                                                                high):
    # Upstream's add_item/end_document cannot express an empty document, so none here.
    documents = sample_documents(2, 60, high, fewest_sequences=1)
    sequences = [sequence for document in documents for sequence in document]
    spec = tmp_path / "spec.npz"
    numpy.savez(spec, tokens=numpy.array([t for s in sequences for t in s], dtype=numpy.int64),
                lengths=numpy.array([len(s) for s in sequences]),
                documents=numpy.cumsum([len(document) for document in documents]),
                dtype=numpy.dtype(dtype).name)
    theirs_prefix = str(tmp_path / "theirs")
    run_upstream(upstream_site, tmp_path, action="write", spec=str(spec), prefix=theirs_prefix)

    theirs = IndexedDataset(theirs_prefix)
    assert [theirs[i].tolist() for i in range(len(theirs))] == sequences
    assert theirs.index.dtype == dtype

    ours_prefix = str(tmp_path / "ours")
    write_ours(ours_prefix, documents, dtype)
    for suffix in (".bin", ".idx"):
        assert Path(ours_prefix + suffix).read_bytes() == Path(theirs_prefix + suffix).read_bytes()


def test_gpt_samples_match_upstream(upstream_site, tmp_path):
    rng = numpy.random.default_rng(3)
    vocab = 5000
    documents = [[rng.integers(0, vocab - 1, size=int(rng.integers(2, 90))).tolist()
                  + [vocab - 1]] for _ in range(1000)]
    prefix = str(tmp_path / "corpus")
    write_ours(prefix, documents, numpy.uint16)
    # Train and valid ask for a few samples more than one epoch holds: the case where the
    # last epoch is shuffled on its own. The test split is a single document, repeated.
    tokens = numpy.cumsum([len(document[0]) for document in documents])
    train_tokens, valid_tokens = int(tokens[948]), int(tokens[998] - tokens[948])
    settings = dict(seed=1234, sequence_length=64, split="949,50,1",
                    sizes=[train_tokens // 64 + 20, valid_tokens // 64 + 5, 3])
    run_upstream(upstream_site, tmp_path, action="gpt", prefix=prefix, vocab=vocab,
                 cache=str(tmp_path / "upstream-cache"), out=str(tmp_path / "gpt.npz"),
                 **settings)
    theirs = numpy.load(tmp_path / "gpt.npz")

    config = GPTDatasetConfig(random_seed=settings["seed"],
                              sequence_length=settings["sequence_length"], blend=([prefix], None),
                              split=settings["split"], tokenizer=NullTokenizer(vocab - 1))
    ours = BlendedMegatronDatasetBuilder(GPTDataset, settings["sizes"], lambda: True,
                                         config).build()
    assert [len(d.document_index) for d in ours[:2]] == [2 * 949, 2 * 50]
    for name, dataset in zip(("train", "valid", "test"), ours):
        for array in ("document_index", "sample_index", "shuffle_index"):
            expected = theirs[f"{name}_{array}"]
            actual = getattr(dataset, array)
            assert actual.dtype == expected.dtype, (name, array)
            assert numpy.array_equal(actual, expected), (name, array)
        tokens = numpy.stack([dataset[i]["tokens"].numpy()
                              for i in range(len(theirs[f"{name}_tokens"]))])
        assert numpy.array_equal(tokens, theirs[f"{name}_tokens"]), name
