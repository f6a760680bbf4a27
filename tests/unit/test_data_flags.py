"""The data flags: where the data comes from (one source, as upstream), per-split blends, files
of data arguments, reading .bin files without a memory map, and when the loader builds masks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy
import pytest
import torch

import pretrain_gpt
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split
from megatron.training import global_vars
from megatron.training.arguments import (
    ArgumentError, parse_args, validate_args, validate_training_args,
)
from megatron.training.data_sources import DataSourceError, check_data_files, \
    get_blend_and_blend_per_split
from tests.unit.test_gpt_dataset import EOD, TOKENIZER, make_documents, write_documents
from tests.unit.test_indexed_dataset import random_documents, write_dataset


@pytest.fixture
def world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


def args_of(*argv):
    training = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
                "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "4",
                "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
    return validate_args(parse_args(argv=["--distributed-backend", "gloo", "--transformer-impl",
                                          "local", *training, *argv]))


def data_args(**given):
    fields = dict(data_path=None, data_args_path=None, train_data_path=None,
                  valid_data_path=None, test_data_path=None, per_split_data_args_path=None,
                  mock_data=False, split=None)
    return SimpleNamespace(**{**fields, **given})


def test_data_path_words_and_a_file_of_them_give_the_same_blend(tmp_path):
    words = ["0.3", "a", "0.7", "b"]
    (tmp_path / "args.txt").write_text("0.3 a\n  0.7   b\n")
    from_flag = get_blend_and_blend_per_split(data_args(data_path=words))
    from_file = get_blend_and_blend_per_split(data_args(data_args_path=str(tmp_path / "args.txt")))
    assert from_flag == from_file == ((["a", "b"], [0.3, 0.7]), None)


def test_per_split_flags_and_json_give_the_same_blends(tmp_path):
    flags = data_args(train_data_path=["2", "t1", "1", "t2"], valid_data_path=["v"])
    spec = {"train": ["2", "t1", "1", "t2"], "valid": "v"}  # a string of words works too
    (tmp_path / "splits.json").write_text(json.dumps(spec))
    from_file = data_args(per_split_data_args_path=str(tmp_path / "splits.json"))
    expected = (None, [(["t1", "t2"], [2.0, 1.0]), (["v"], None), None])
    assert get_blend_and_blend_per_split(flags) == expected
    assert get_blend_and_blend_per_split(from_file) == expected
    assert get_blend_and_blend_per_split(data_args(mock_data=True)) == (None, None)


@pytest.mark.parametrize("argv,message", [
    (["--data-path", "a", "--mock-data"], "give a single data source, not --data-path and "
                                          "--mock-data"),
    (["--data-path", "a", "--train-data-path", "b"], "not --data-path and --train-data-path"),
    (["--data-path", "a", "--data-args-path", "f"], "--data-path and --data-args-path are "
                                                   "alternatives"),
    (["--per-split-data-args-path", "f", "--valid-data-path", "v"],
     "not --per-split-data-args-path and --valid-data-path"),
    (["--train-data-path", "t", "--split", "99,1,0"], "--split cuts one blend"),
])
def test_more_than_one_source_is_named(world, argv, message):
    with pytest.raises(ArgumentError, match=message):
        args_of(*argv)


@pytest.mark.parametrize("content,message", [
    (None, "--data-args-path {path}: cannot read it"),
    ("", "--data-args-path {path}: the data path list is empty"),
])
def test_bad_data_args_file_is_named_before_training(world, tmp_path, content, message):
    path = tmp_path / "args.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ArgumentError, match=message.format(path=path)):
        validate_training_args(args_of("--data-args-path", str(path)))


@pytest.mark.parametrize("content,message", [
    ("{not json", "not JSON"),
    ('{"training": ["a"]}', "expected an object with keys among"),
    ('{"train": {"a": 1}}', "'train' must be a list of prefixes"),
    ('{"train": ["0.5", "a", "b", "c"]}', r"\(train\): data path list .* mixes weights"),
])
def test_bad_per_split_file_is_named_before_training(world, tmp_path, content, message):
    path = tmp_path / "splits.json"
    path.write_text(content)
    with pytest.raises(ArgumentError, match=f"--per-split-data-args-path {path}.*{message}"):
        validate_training_args(args_of("--per-split-data-args-path", str(path)))


def test_training_needs_some_data(world):
    with pytest.raises(ArgumentError, match="pretraining needs --data-path .*--mock-data"):
        validate_training_args(args_of())


def test_a_data_prefix_without_its_files_is_named_with_its_flag(world, tmp_path):
    whole = str(tmp_path / "whole")
    write_documents(whole, make_documents(4, seed=0))
    check_data_files(args_of("--data-path", whole))  # both files there
    with pytest.raises(DataSourceError, match=rf"^--data-path: {tmp_path}/gone\.idx does not "
                                              r"exist \(a data path is the prefix"):
        check_data_files(args_of("--data-path", "0.5", whole, "0.5", str(tmp_path / "gone")))
    (tmp_path / "half.idx").write_bytes(b"")
    with pytest.raises(DataSourceError,
                       match=rf"^--valid-data-path: {tmp_path}/half\.bin does not exist"):
        check_data_files(args_of("--train-data-path", whole, "--valid-data-path",
                                 str(tmp_path / "half")))
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": [whole], "test": [str(tmp_path / "gone")]}))
    with pytest.raises(DataSourceError, match=rf"^--per-split-data-args-path {splits} \(test\): "
                                              rf"{tmp_path}/gone\.idx"):
        check_data_files(args_of("--per-split-data-args-path", str(splits)))
    check_data_files(args_of("--mock-data"))  # no files to look for


SPLIT = ["--split", "9,1,0"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    directory = tmp_path_factory.mktemp("splits")
    return {name: write_documents(str(directory / name), make_documents(120, seed=seed))
            for seed, name in enumerate(("train", "valid", "test"))}


def provider_config(monkeypatch, *argv):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    args = args_of(*argv)
    validate_training_args(args)
    monkeypatch.setattr(global_vars, "_TOKENIZER", TOKENIZER)
    return args, pretrain_gpt.core_gpt_dataset_config_from_args(args)


def build(config, sizes=(40, 16, 8)):
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, config).build()


def test_per_split_paths_build_each_split_from_its_own_data(monkeypatch, corpora):
    _, config = provider_config(monkeypatch, "--train-data-path", corpora["train"],
                                "--valid-data-path", corpora["valid"],
                                "--test-data-path", corpora["test"])
    assert config.blend is None and config.split is None
    datasets = build(config)
    for split, dataset in zip(Split, datasets):
        assert dataset.dataset_path == corpora[split.name] and len(dataset) >= (40, 16, 8)[
            split.value]
    # Only a training split: the others are not built.
    _, config = provider_config(monkeypatch, "--train-data-path", corpora["train"])
    assert [dataset is not None for dataset in build(config)] == [True, False, False]


def test_data_args_path_builds_what_data_path_builds(monkeypatch, corpora, tmp_path):
    words = f"1 {corpora['train']} 2 {corpora['valid']}"
    (tmp_path / "args.txt").write_text(words)
    _, default = provider_config(monkeypatch, "--data-args-path", str(tmp_path / "args.txt"))
    assert default.split == "969,30,1"  # upstream's legacy default, as with --data-path
    _, direct = provider_config(monkeypatch, "--data-path", *words.split(), *SPLIT)
    _, from_file = provider_config(monkeypatch, "--data-args-path", str(tmp_path / "args.txt"),
                                   *SPLIT)
    assert direct.blend == from_file.blend == ([corpora["train"], corpora["valid"]], [1.0, 2.0])
    first, second = build(direct)[0], build(from_file)[0]
    assert [first[i]["tokens"].tolist() for i in range(20)] == \
        [second[i]["tokens"].tolist() for i in range(20)]


def test_no_mmap_reads_the_same_bytes_as_the_memory_map(tmp_path):
    prefix = str(tmp_path / "data")
    documents = random_documents(numpy.random.default_rng(3), 40, 60000)
    write_dataset(prefix, documents)
    mapped, read = IndexedDataset(prefix, mmap=True), IndexedDataset(prefix, mmap=False)
    for index in range(len(mapped)):
        assert numpy.array_equal(mapped[index], read[index])
        assert numpy.array_equal(mapped.get(index, 1), read.get(index, 1))
    assert all(numpy.array_equal(a, b) for a, b in zip(mapped[5:25], read[5:25]))


def test_no_mmap_bin_files_gives_the_same_samples(monkeypatch, corpora):
    _, mapped = provider_config(monkeypatch, "--data-path", corpora["train"], *SPLIT)
    _, read = provider_config(monkeypatch, "--data-path", corpora["train"], *SPLIT,
                              "--no-mmap-bin-files")
    assert mapped.mmap_bin_files and not read.mmap_bin_files
    with_map, without = build(mapped)[0], build(read)[0]
    assert not without.dataset.mmap
    for index in range(len(with_map)):
        assert torch.equal(with_map[index]["tokens"], without[index]["tokens"])


@pytest.mark.parametrize("argv,mask", [
    ([], False),  # causal: attention needs no mask
    (["--reset-attention-mask"], True),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"], False),
])
def test_the_loader_builds_only_masks_that_say_more_than_causal(monkeypatch, corpora, argv,
                                                                mask):
    _, config = provider_config(monkeypatch, "--data-path", corpora["train"], *SPLIT, *argv)
    assert config.create_attention_mask is mask
    sample = build(config)[0][0]
    assert ("attention_mask" in sample) is mask
    if mask:  # documents kept apart: a token after an end of document sees none before it
        tokens = sample["tokens"]
        after = int((tokens[:-1] == EOD).nonzero()[0]) + 1
        assert sample["attention_mask"][0, after, :after].all()


def test_dataset_builder_threads_build_the_same_blend(monkeypatch, corpora):
    blend = ["1", corpora["train"], "1", corpora["valid"], "1", corpora["test"]]
    _, one = provider_config(monkeypatch, "--data-path", *blend, *SPLIT)
    _, three = provider_config(monkeypatch, "--data-path", *blend, *SPLIT,
                               "--num-dataset-builder-threads", "3")
    assert three.num_dataset_builder_threads == 3
    serial, threaded = build(one)[0], build(three)[0]
    assert [serial[i]["tokens"].tolist() for i in range(len(serial))] == \
        [threaded[i]["tokens"].tolist() for i in range(len(threaded))]
