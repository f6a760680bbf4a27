"""GPT datasets: index building, sample contents, determinism, splits, blends, caching, masks."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy
import pytest
import torch

from megatron.core.datasets.blended_dataset import build_blending_indices, samples_per_dataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.gpt_indices import build_sample_index
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron.core.datasets.ltor_masks import get_ltor_masks_and_position_ids
from megatron.core.datasets.utils import Split, get_blend_from_list
from megatron.training.tokenizer import NullTokenizer

VOCAB = 1000
TOKENIZER = NullTokenizer(VOCAB)  # eod is id 1000
EOD = TOKENIZER.eod


def write_documents(prefix: str, documents: list[numpy.ndarray]) -> str:
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    for document in documents:
        builder.add_item(document)
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def make_documents(count: int, seed: int = 0, high: int = VOCAB, longest: int = 60):
    """Random documents ending in eod; the first token is 10 * document number mod high."""
    rng = numpy.random.default_rng(seed)
    documents = []
    for number in range(count):
        body = rng.integers(0, high, size=int(rng.integers(1, longest)))
        body[0] = (10 * number) % high
        documents.append(numpy.append(body, EOD))
    return documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt")
    documents = make_documents(400)
    return write_documents(str(directory / "corpus"), documents), documents


def config(prefix=None, **overrides) -> GPTDatasetConfig:
    settings = dict(random_seed=1234, sequence_length=32, tokenizer=TOKENIZER,
                    create_attention_mask=False)
    if prefix is not None:
        settings.update(blend=([prefix], None), split="1,0,0")
    settings.update(overrides)
    return GPTDatasetConfig(**settings)


def build(cls, sizes, cfg):
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, cfg).build()


def fingerprint(dataset, count: int = 50) -> str:
    digest = hashlib.sha256()
    for index in range(min(count, len(dataset))):
        digest.update(dataset[index]["tokens"].numpy().tobytes())
    return digest.hexdigest()


# ---- sample index ------------------------------------------------------------------------------

def reference_sample_index(lengths, document_index, sequence_length, extra=1, keep_partial=False):
    """Walk the token stream sample by sample (the obvious, slow way)."""
    stream_owner = [(position, offset) for position, document in enumerate(document_index)
                    for offset in range(lengths[document])]
    last = len(document_index) - 1
    stream_owner.append((last, lengths[document_index[last]]))  # one past the end
    usable = len(stream_owner) - 1 - extra
    starts = list(range(0, usable + 1, sequence_length))
    if keep_partial and starts[-1] < usable:
        starts.append(usable)
    return numpy.array([stream_owner[start] for start in starts])


@pytest.mark.parametrize("extra, keep_partial", [(1, False), (0, False), (1, True), (0, True)])
@pytest.mark.parametrize("sequence_length", [1, 3, 7, 64])
def test_sample_index_matches_a_token_walk(sequence_length, extra, keep_partial):
    rng = numpy.random.default_rng(sequence_length)
    lengths = rng.integers(0, 20, size=200).astype(numpy.int32)  # includes empty sequences
    document_index = rng.permutation(numpy.tile(numpy.arange(200, dtype=numpy.int32), 2))
    expected = reference_sample_index(lengths, document_index, sequence_length, extra,
                                      keep_partial)
    built = build_sample_index(lengths, document_index, sequence_length, bool(extra),
                               drop_last_partial=not keep_partial)
    assert numpy.array_equal(built, expected)


def test_sample_index_scales_linearly():
    # 2 million documents, ~1 billion tokens: built in well under a second, no Python loop.
    rng = numpy.random.default_rng(0)
    lengths = rng.integers(1, 1000, size=2_000_000).astype(numpy.int32)
    document_index = numpy.arange(len(lengths), dtype=numpy.int32)
    sample_index = build_sample_index(lengths, document_index, 4096)
    ends = numpy.cumsum(lengths, dtype=numpy.int64)
    starts = numpy.arange(len(sample_index), dtype=numpy.int64) * 4096
    owners = numpy.searchsorted(ends, starts, side="right")
    assert numpy.array_equal(sample_index[:, 0], owners)
    assert numpy.array_equal(sample_index[:, 1], starts - (ends - lengths)[owners])


def test_packed_samples_are_windows_of_the_shuffled_stream(corpus):
    prefix, documents = corpus
    (train, _, _) = build(GPTDataset, [300, None, None], config(prefix))
    stream = numpy.concatenate([documents[i] for i in train.document_index])
    unshuffle = numpy.argsort(train.shuffle_index)
    for row in (0, 1, 17, len(train) - 1):
        sample = train[int(unshuffle[row])]
        window = stream[row * 32: row * 32 + 33]
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
        assert sample["position_ids"].tolist() == list(range(32))
        assert sample["loss_mask"].tolist() == [1.0] * 32
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}


def test_samples_without_the_extra_token_do_not_overlap(corpus):
    prefix, documents = corpus
    (train, _, _) = build(GPTDataset, [300, None, None],
                          config(prefix, add_extra_token_to_sequence=False))
    stream = numpy.concatenate([documents[i] for i in train.document_index])
    unshuffle = numpy.argsort(train.shuffle_index)
    for row in (0, 1, 17, len(train) - 1):
        sample = train[int(unshuffle[row])]
        window = stream[row * 32: row * 32 + 32]
        assert sample["tokens"].tolist() == window.tolist()
        assert sample["labels"].tolist() == window[1:].tolist() + [0]  # padding, no loss
        assert sample["loss_mask"].tolist() == [1.0] * 31 + [0.0]


def test_a_kept_partial_validation_sample_is_padded_without_loss(tmp_path):
    documents = make_documents(50, seed=3)
    prefix = write_documents(str(tmp_path / "valid"), documents)
    settings = dict(blend=([prefix], None), split="0,1,0")
    tokens = sum(len(document) for document in documents)
    assert (tokens - 1) % 32, "the corpus must leave a partial sample"
    (_, dropped, _) = build(GPTDataset, [None, None, None], config(**settings))
    (_, kept, _) = build(GPTDataset, [None, None, None],
                         config(**settings, drop_last_partial_validation_sequence=False))
    assert len(dropped) == (tokens - 1) // 32 and len(kept) == len(dropped) + 1
    last = kept[int(numpy.argmax(kept.shuffle_index))]
    stream = numpy.concatenate([documents[i] for i in kept.document_index])
    real = (tokens - 1) % 32
    # The stream's last real + 1 tokens; the last of them has only padding to predict.
    assert last["tokens"][:real + 1].tolist() == stream[-real - 1:].tolist()
    assert last["labels"][:real].tolist() == stream[-real:].tolist()
    assert not last["labels"][real:].any() and not last["tokens"][real + 1:].any()
    assert last["loss_mask"].tolist() == [1.0] * real + [0.0] * (32 - real)
    padding = kept[None]
    assert padding["tokens"].shape == (32,) and not padding["loss_mask"].any()


def test_epochs_cover_the_requested_samples(corpus):
    prefix, documents = corpus
    tokens = sum(len(document) for document in documents)
    wanted = 3 * tokens // 32 + 1  # just more than three epochs hold
    (train, _, _) = build(GPTDataset, [wanted, None, None], config(prefix))
    assert len(train) >= wanted
    assert numpy.bincount(train.document_index).tolist() == [4] * len(documents)


# ---- determinism ---------------------------------------------------------------------------------

def test_same_seed_same_samples_across_processes(corpus):
    prefix, _ = corpus
    first = fingerprint(build(GPTDataset, [500, None, None], config(prefix))[0])
    again = fingerprint(build(GPTDataset, [500, None, None], config(prefix))[0])
    other_seed = fingerprint(build(GPTDataset, [500, None, None],
                                   config(prefix, random_seed=99))[0])
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from tests.unit.test_gpt_dataset import *;"
        "print(fingerprint(build(GPTDataset, [500, None, None], config(sys.argv[2]))[0]))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    other_process = subprocess.run([sys.executable, "-c", script, root, prefix], check=True,
                                   capture_output=True, text=True).stdout.split()[-1]
    assert first == again == other_process
    assert other_seed != first


# ---- splits --------------------------------------------------------------------------------------

def test_split_949_50_1_cuts_consecutive_ranges(tmp_path):
    prefix = write_documents(str(tmp_path / "d"), make_documents(1000))
    train, valid, test = build(GPTDataset, [10, 10, 10], config(prefix, split="949,50,1"))
    ranges = [(int(d.indices[0]), int(d.indices[-1]) + 1) for d in (train, valid, test)]
    assert ranges == [(0, 949), (949, 999), (999, 1000)]
    assert set(numpy.unique(valid.document_index)) == set(range(949, 999))


def test_split_parsing():
    assert parse_and_normalize_split("949,50,1") == pytest.approx([0.949, 0.05, 0.001])
    assert parse_and_normalize_split("3, 1") == pytest.approx([0.75, 0.25, 0.0])
    for bad in ("a,b,c", "1,2,3,4", "0,0,0", "-1,2,0"):
        with pytest.raises(ValueError, match=f"--split {bad!r}"):
            parse_and_normalize_split(bad)


def test_zero_share_split_is_none_and_empty_split_is_an_error(tmp_path):
    prefix = write_documents(str(tmp_path / "d"), make_documents(10))
    train, valid, test = build(GPTDataset, [10, 10, 10], config(prefix, split="90,10,0"))
    assert test is None and len(valid.indices) == 1
    with pytest.raises(ValueError, match=r"the valid split of --split '98,1,1' gets no sequence "
                                         r"of .*/d, which has 10"):
        build(GPTDataset, [10, 10, 10], config(prefix, split="98,1,1"))


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="split .* is required with blend"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, blend=(["x"], None))
    with pytest.raises(ValueError, match="has 2 prefixes but 1 weights"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, blend=(["x", "y"], [1.0]), split="1")
    with pytest.raises(ValueError, match="blend_per_split needs 3 entries"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, blend_per_split=[(["x"], None)])
    with pytest.raises(ValueError, match="eod_mask_loss need the end-of-document id"):
        GPTDatasetConfig(random_seed=1, sequence_length=8, eod_mask_loss=True)
    with pytest.raises(ValueError, match="GPTDataset needs data"):
        build(GPTDataset, [1, 1, 1], config())
    with pytest.raises(FileNotFoundError, match="nothing.idx does not exist"):
        build(GPTDataset, [1, None, None], config(str(tmp_path / "nothing")))


# ---- blends --------------------------------------------------------------------------------------

def test_weighted_blend_follows_the_weights(tmp_path):
    small = write_documents(str(tmp_path / "small"), make_documents(50, seed=1))
    large = write_documents(str(tmp_path / "large"), make_documents(300, seed=2))
    cfg = config(blend=([small, large], [0.25, 0.75]), split="1,0,0")
    train, valid, test = build(GPTDataset, [1000, None, None], cfg)
    assert valid is None and test is None and len(train) == 1000
    assert numpy.bincount(train.dataset_index).tolist() == [250, 750]
    prefix_counts = numpy.cumsum(train.dataset_index == 0)
    expected = 0.25 * numpy.arange(1, 1001)
    assert numpy.abs(prefix_counts - expected).max() <= 1.0
    assert train[5]["dataset_id"] == train.dataset_index[5]
    assert fingerprint(train) == fingerprint(build(GPTDataset, [1000, None, None], cfg)[0])


def test_unweighted_blend_follows_dataset_sizes(tmp_path):
    first = write_documents(str(tmp_path / "a"), make_documents(40, seed=3))
    second = write_documents(str(tmp_path / "b"), make_documents(120, seed=4))
    (train, _, _) = build(GPTDataset, [None, None, None],
                          config(blend=([first, second], None), split="1,0,0"))
    sizes = [len(dataset) for dataset in train.datasets]
    assert numpy.bincount(train.dataset_index).tolist() == sizes


def test_blend_per_split(tmp_path):
    first = write_documents(str(tmp_path / "a"), make_documents(40, seed=3))
    second = write_documents(str(tmp_path / "b"), make_documents(40, seed=4))
    cfg = config(blend_per_split=[([first, second], [1, 3]), None, ([second], None)])
    train, valid, test = build(GPTDataset, [100, 5, 5], cfg)
    assert numpy.bincount(train.dataset_index).tolist() == [25, 75]
    assert valid is None and test.dataset_path == second


def test_blending_indices_are_exact_and_spread():
    counts = samples_per_dataset([0.2, 0.3, 0.5], 1001)
    assert counts.sum() == 1001 and counts.tolist() == [200, 300, 501]
    owners, numbers = build_blending_indices(counts)
    for dataset, count in enumerate(counts):
        assert numbers[owners == dataset].tolist() == list(range(count))


def test_get_blend_from_list():
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    assert get_blend_from_list(["30", "a", "70", "b"]) == (["a", "b"], [30.0, 70.0])
    assert get_blend_from_list([" a "]) == (["a"], None)
    assert get_blend_from_list([1, "a", 2.5, "b"]) == (["a", "b"], [1.0, 2.5])
    with pytest.raises(ValueError, match="mixes weights and prefixes"):
        get_blend_from_list(["30", "a", "b", "c"])


# ---- one document per sample -----------------------------------------------------------------

def test_unpacked_samples_are_whole_documents_in_seeded_order(tmp_path):
    documents = make_documents(100, longest=80)
    documents[7] = numpy.array([EOD])  # one token: no label, skipped
    prefix = write_documents(str(tmp_path / "d"), documents)
    (train, _, _) = build(GPTDataset, [150, None, None], config(prefix, pack_sequences=False))
    assert len(train) == 198  # two shuffled epochs of the 99 usable documents
    assert 7 not in set(train.document_index.tolist())
    lengths = set()
    for index in range(len(train)):
        document = documents[int(train.document_index[index])][:33]
        sample = train[index]
        assert sample["tokens"].tolist() == document[:-1].tolist()
        assert sample["labels"].tolist() == document[1:].tolist()
        lengths.add(len(sample["tokens"]))
    assert len(lengths) > 10 and max(lengths) == 32
    again = build(GPTDataset, [150, None, None], config(prefix, pack_sequences=False))[0]
    reseeded = build(GPTDataset, [150, None, None],
                     config(prefix, pack_sequences=False, random_seed=7))[0]
    assert numpy.array_equal(again.document_index, train.document_index)
    assert not numpy.array_equal(reseeded.document_index, train.document_index)


# ---- masks ---------------------------------------------------------------------------------------

def reference_masks(tokens, eod):
    """Upstream's behaviour written as plain loops."""
    n = len(tokens)
    allowed = numpy.tril(numpy.ones((n, n), dtype=bool))
    positions = list(range(n))
    loss = [0.0 if token == eod else 1.0 for token in tokens]
    previous = 0
    for i, token in enumerate(tokens):
        if token == eod:
            allowed[i + 1:, :i + 1] = False
            for j in range(i + 1, n):
                positions[j] -= i + 1 - previous
            previous = i + 1
    return ~allowed, loss, positions


def test_masks_with_resets_match_the_reference():
    tokens = torch.tensor([5, 6, 9, 7, 9, 9, 1, 2, 3, 9])
    mask, loss, positions = get_ltor_masks_and_position_ids(tokens, 9, True, True, True, True)
    expected_mask, expected_loss, expected_positions = reference_masks(tokens.tolist(), 9)
    assert mask.shape == (1, 10, 10) and mask.dtype == torch.bool
    assert numpy.array_equal(mask[0].numpy(), expected_mask)
    assert loss.tolist() == expected_loss
    assert positions.tolist() == expected_positions


def test_dataset_applies_eod_options(corpus):
    prefix, _ = corpus
    cfg = config(prefix, reset_position_ids=True, eod_mask_loss=True, create_attention_mask=True)
    sample = build(GPTDataset, [20, None, None], cfg)[0][3]
    _, expected_loss, expected_positions = reference_masks(sample["tokens"].tolist(), EOD)
    assert sample["loss_mask"].tolist() == expected_loss
    assert sample["position_ids"].tolist() == expected_positions
    assert sample["attention_mask"].shape == (1, 32, 32)


# ---- vocabulary, caching, mock -------------------------------------------------------------------

def test_token_ids_beyond_the_vocabulary_are_reported(corpus):
    prefix, _ = corpus
    small = NullTokenizer(100)
    (train, _, _) = build(GPTDataset, [20, None, None], config(prefix, tokenizer=small))
    with pytest.raises(ValueError, match=r"corpus: sample 0 of the train split holds token id "
                                         r"\d+, outside the vocabulary of NullTokenizer "
                                         r"\(101 ids\)"):
        train[0]


def test_index_cache_round_trip(corpus, tmp_path):
    prefix, _ = corpus
    cache = str(tmp_path / "cache")
    first = build(GPTDataset, [200, None, None], config(prefix, path_to_cache=cache))[0]
    assert first.built_anew_on_cache_miss
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not any(".tmp" in name for name in files)
    second = build(GPTDataset, [200, None, None], config(prefix, path_to_cache=cache))[0]
    assert not second.built_anew_on_cache_miss
    assert numpy.array_equal(first.sample_index, second.sample_index)
    assert fingerprint(first) == fingerprint(second)

    # An entry whose description is missing (an interrupted write) is rebuilt.
    os.remove(os.path.join(cache, next(name for name in files if name.endswith(".txt"))))
    assert build(GPTDataset, [200, None, None],
                 config(prefix, path_to_cache=cache))[0].built_anew_on_cache_miss
    build(GPTDataset, [200, None, None], config(prefix, path_to_cache=cache, random_seed=5))
    assert len(os.listdir(cache)) == 8


def test_mock_data():
    cfg = config(sequence_length=64, tokenizer=NullTokenizer(300))
    train, valid, test = build(MockGPTDataset, [100, 10, 10], cfg)
    assert len(train) >= 100 and len(valid) >= 10 and len(test) >= 10
    sample = train[0]
    assert sample["tokens"].shape == (64,) and int(sample["tokens"].max()) <= 300
    assert fingerprint(train) == fingerprint(build(MockGPTDataset, [100, 10, 10], cfg)[0])
    low_level = train.dataset
    document = low_level[3]
    assert document[-1] == 300 and 300 not in document[:-1].tolist()
    assert type(train).__name__ == "MockGPTDataset" and train.index_split is Split.train
    with pytest.raises(ValueError, match="MockGPTDataset .* is built without data paths"):
        BlendedMegatronDatasetBuilder(MockGPTDataset, [1, 1, 1], lambda: True,
                                      config("some/prefix"))


# ---- distributed build ---------------------------------------------------------------------------

def _build_on_rank(rank: int, init_file: str, prefix: str, cache: str, split: str, results):
    import datetime

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        cfg = config(prefix, path_to_cache=cache, split=split)
        train = build(GPTDataset, [100, 10, 10], cfg)[0]
        results.put((rank, "built", train.built_anew_on_cache_miss, fingerprint(train)))
    except ValueError as error:
        results.put((rank, "error", str(error), None))
    finally:
        torch.distributed.destroy_process_group()


def _run_two_ranks(tmp_path, prefix: str, split: str) -> dict:
    import multiprocessing

    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=_build_on_rank,
                                 args=(rank, str(tmp_path / "init"), prefix,
                                       str(tmp_path / "cache"), split, results))
                 for rank in range(2)]
    for process in processes:
        process.start()
    outcome = {}
    for _ in processes:
        rank, kind, detail, digest = results.get(timeout=90)
        outcome[rank] = (kind, detail, digest)
    for process in processes:
        process.join(timeout=30)
    return outcome


def test_rank_zero_builds_the_cache_and_others_load_it(corpus, tmp_path):
    prefix, _ = corpus
    outcome = _run_two_ranks(tmp_path, prefix, "90,5,5")
    assert outcome[0][:2] == ("built", True) and outcome[1][:2] == ("built", False)
    assert outcome[0][2] == outcome[1][2]


def test_an_error_on_rank_zero_does_not_hang_the_others(tmp_path):
    prefix = write_documents(str(tmp_path / "d"), make_documents(10))
    outcome = _run_two_ranks(tmp_path, prefix, "98,1,1")
    assert [outcome[rank][0] for rank in (0, 1)] == ["error", "error"]
    assert "the valid split of --split '98,1,1'" in outcome[1][1]

