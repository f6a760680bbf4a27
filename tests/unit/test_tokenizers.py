"""Tokenizers and build_tokenizer: upstream's special ids, vocabulary padding, GPT-2 BPE."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from megatron.training.flags.schema import add_config_arguments
from megatron.training.tokenizer import (
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    TokenizerArgs,
    build_tokenizer,
)
from megatron.training.tokenizer import tokenizer as tokenizer_module
from megatron.training.tokenizer.tokenizer_args import TOKENIZER_TYPES

TEXT = ("The quick brown fox jumps over the lazy dog. Seven plus two is nine. "
        "A small boat sailed to the old mill on Tuesday. ")


def make_args(**values) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, "tokenizer", TokenizerArgs)
    args = parser.parse_args([])
    args.rank = 0
    args.tensor_model_parallel_size = 1
    args.make_vocab_size_divisible_by = 128
    for name, value in values.items():
        setattr(args, name, value)
    return args


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> str:
    import sentencepiece

    prefix = str(tmp_path_factory.mktemp("spm") / "model")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([TEXT * 3] * 50), model_prefix=prefix, vocab_size=60,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        hard_vocab_limit=False)
    return prefix + ".model"


# ---- NullTokenizer and build_tokenizer -----------------------------------------------------------

def test_null_tokenizer():
    tokenizer = NullTokenizer(50)
    assert tokenizer.tokenize("3 14  15\n9") == [3, 14, 15, 9]
    assert tokenizer.detokenize([3, 14]) == "3 14"
    assert tokenizer.offsets([3, 14, 15], "3 14 15") == [0, 2, 5]
    assert (tokenizer.vocab_size, tokenizer.eod) == (51, 50)
    assert tokenizer.tokenize("50") == [50]
    with pytest.raises(ValueError, match=r"token id 51 is outside the vocabulary \[0, 51\)"):
        tokenizer.tokenize("1 51")
    with pytest.raises(ValueError, match="got 'x'"):
        tokenizer.tokenize("1 x")
    with pytest.raises(NotImplementedError):
        tokenizer.vocab
    with pytest.raises(NotImplementedError, match="NullTokenizer has no bos token"):
        tokenizer.bos


@pytest.mark.parametrize("tensor_parallel, divisible_by, padded",
                         [(1, 128, 1024), (2, 128, 1024), (8, 128, 1024), (3, 100, 1200),
                          (1, 1, 1001)])
def test_padded_vocab_size(tensor_parallel, divisible_by, padded):
    args = make_args(tokenizer_type="NullTokenizer", vocab_size=1000,
                     tensor_model_parallel_size=tensor_parallel,
                     make_vocab_size_divisible_by=divisible_by)
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == 1001 and args.padded_vocab_size == padded


def test_padded_vocab_size_from_a_checkpoint_is_kept():
    args = make_args(tokenizer_type="NullTokenizer", vocab_size=10, padded_vocab_size=4096)
    build_tokenizer(args)
    assert args.padded_vocab_size == 4096


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-type 'BertWordPieceCase' is not supported"):
        build_tokenizer(make_args(tokenizer_type="BertWordPieceCase"))
    with pytest.raises(ValueError, match="Llama2Tokenizer needs --tokenizer-model"):
        build_tokenizer(make_args(tokenizer_type="Llama2Tokenizer"))
    with pytest.raises(FileNotFoundError, match="--tokenizer-model .*nope.model: no such file"):
        build_tokenizer(make_args(tokenizer_type="Llama2Tokenizer",
                                  tokenizer_model=str(tmp_path / "nope.model")))
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a readable SentencePiece model"):
        build_tokenizer(make_args(tokenizer_type="Llama2Tokenizer",
                                  tokenizer_model=str(tmp_path / "bad.model")))
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match="needs --merge-file"):
        build_tokenizer(make_args(tokenizer_type="GPT2BPETokenizer",
                                  vocab_file=str(tmp_path / "vocab.json")))


def test_every_declared_type_can_be_built():
    assert tuple(tokenizer_module._BUILDERS) == TOKENIZER_TYPES


def test_padding_defaults_to_a_multiple_of_128():
    args = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=1000)
    build_tokenizer(args)
    assert args.padded_vocab_size == 1024


# ---- SentencePiece family ------------------------------------------------------------------------

def test_llama2_tokenizer(sentencepiece_model):
    tokenizer = build_tokenizer(make_args(tokenizer_type="Llama2Tokenizer",
                                          tokenizer_model=sentencepiece_model))
    assert isinstance(tokenizer, Llama2Tokenizer)
    ids = tokenizer.tokenize("the lazy fox")
    assert ids[0] == 1 and 2 not in ids
    assert tokenizer.tokenize("the lazy fox", bos=False, eos=True) == ids[1:] + [2]
    assert tokenizer.detokenize(ids) == "the lazy fox"
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod, tokenizer.pad) == (1, 2, 2, -1)
    assert (tokenizer.cls, tokenizer.sep, tokenizer.mask) == (-1, -1, -1)
    assert tokenizer.vocab_size == len(tokenizer.tokenizer) == len(tokenizer.vocab)
    assert tokenizer.inv_vocab[1] == "<s>"


def test_gpt_sentencepiece_tokenizer(sentencepiece_model):
    tokenizer = GPTSentencePieceTokenizer(sentencepiece_model)
    ids = tokenizer.tokenize("the lazy fox")
    assert ids[0] != 1 and tokenizer.eod == 2 and tokenizer.detokenize(ids) == "the lazy fox"


def test_sentencepiece_tokenizer_special_tokens(sentencepiece_model):
    tokenizer = SentencePieceTokenizer(sentencepiece_model, vocab_extra_ids=2)
    base = len(tokenizer.tokenizer)
    assert (tokenizer.cls, tokenizer.sep, tokenizer.eod, tokenizer.mask, tokenizer.pad) == \
        (base, base + 1, base + 2, base + 3, base + 4)
    assert (tokenizer.bos, tokenizer.eos) == (1, 2)  # the model's own pieces
    assert tokenizer.additional_special_tokens_ids == [base + 5, base + 6]
    assert tokenizer.vocab_size == base + 7
    plain = tokenizer.tokenizer.encode_as_ids
    ids = tokenizer.tokenize("the fox<EOD>the dog<extra_id_1></s>")
    assert ids == plain("the fox") + [base + 2] + plain("the dog") + [base + 6, 2]
    assert tokenizer.detokenize(plain("the fox") + [base + 2]) == "the fox <EOD> "


# ---- GPT-2 BPE -----------------------------------------------------------------------------------

def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "f"), ("o", "x"), ("Ġf", "ox"),
          ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġ", "l"), ("a", "z"), ("Ġl", "az"),
          ("Ġlaz", "y"), ("Ã", "©"), ("1", "2")]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt2")
    pieces = list(byte_alphabet().values()) + ["".join(pair) for pair in MERGES]
    vocab = {piece: index for index, piece in enumerate(dict.fromkeys(pieces))}
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES), encoding="utf-8")
    return str(directory / "vocab.json"), str(directory / "merges.txt"), vocab


def reference_gpt2_encode(text: str, vocab: dict[str, int]) -> list[int]:
    """GPT-2's encoder written out plainly (pre-tokenise, bytes to alphabet, lowest-rank merges)."""
    letters, numbers = r"[^\W\d_]", r"\d"
    pattern = re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?{letters}+| ?{numbers}+"
                         rf"| ?[^\s\w]+|\s+(?!\S)|\s+")
    alphabet, ranks = byte_alphabet(), {pair: rank for rank, pair in enumerate(MERGES)}
    ids = []
    for word in pattern.findall(text):
        parts = [alphabet[byte] for byte in word.encode("utf-8")]
        while len(parts) > 1:
            pairs = [(ranks.get((a, b), len(ranks)), i) for i, (a, b) in
                     enumerate(zip(parts, parts[1:]))]
            rank, position = min(pairs)
            if rank == len(ranks):
                break
            parts[position:position + 2] = [parts[position] + parts[position + 1]]
        ids.extend(vocab[part] for part in parts)
    return ids


@pytest.mark.parametrize("text", ["the fox", "The lazy fox, the lazy dog!", "  the  fox  ",
                                  "in 12 121 days: café, naïve ✓", "it's the fox's",
                                  "\tthe\n\nfox"])
def test_gpt2_bpe_matches_the_reference(gpt2_files, text):
    vocab_file, merge_file, vocab = gpt2_files
    tokenizer = build_tokenizer(make_args(tokenizer_type="GPT2BPETokenizer",
                                          vocab_file=vocab_file, merge_file=merge_file))
    assert isinstance(tokenizer, GPT2BPETokenizer)
    ids = tokenizer.tokenize(text)
    assert ids == reference_gpt2_encode(text, vocab)
    assert tokenizer.detokenize(ids) == text


def test_gpt2_bpe_special_ids(gpt2_files, tmp_path):
    vocab_file, merge_file, vocab = gpt2_files
    tokenizer = GPT2BPETokenizer(vocab_file, merge_file)
    assert tokenizer.eod == vocab["<|endoftext|>"] == tokenizer.vocab_size - 1
    assert tokenizer.eod not in tokenizer.tokenize("a<|endoftext|>b")  # plain text, as upstream
    assert tokenizer.vocab["Ġthe"] == vocab["Ġthe"] and tokenizer.inv_vocab[vocab["!"]] == "!"
    without_eod = {piece: index for piece, index in vocab.items() if piece != "<|endoftext|>"}
    (tmp_path / "vocab.json").write_text(json.dumps(without_eod))
    with pytest.raises(ValueError, match="has no <|endoftext|> token"):
        GPT2BPETokenizer(str(tmp_path / "vocab.json"), merge_file)
