"""Build the quickstart's data in seconds: a tiny SentencePiece model and the tokenized corpus.

    python tools/make_quickstart_data.py [OUTPUT_DIR]     # default examples/quickstart/data/build

From the bundled ``examples/quickstart/data/corpus.jsonl`` (generated English-like text, public
domain) it writes into OUTPUT_DIR:

* ``tokenizer.model``: a SentencePiece unigram model (Llama-style ids: unk 0, bos 1, eos 2; byte
  fallback, so any text can be encoded)
* ``corpus_text_document.bin`` / ``.idx``: the corpus tokenized by ``tools/preprocess_data.py``
  with ``--tokenizer-type Llama2Tokenizer --append-eod``

and prints the training flags that use them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import preprocess_data

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(REPO_ROOT, "examples", "quickstart", "data", "corpus.jsonl")
DEFAULT_OUTPUT = os.path.join(REPO_ROOT, "examples", "quickstart", "data", "build")


def train_tokenizer(corpus: str, model_path: str, vocab_size: int) -> None:
    """Train a SentencePiece unigram model on the ``text`` of every line of ``corpus``."""
    import sentencepiece

    with open(corpus, encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream if line.strip()]
    with tempfile.TemporaryDirectory(dir=os.path.dirname(model_path)) as scratch:
        prefix = os.path.join(scratch, "tokenizer")
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=vocab_size,
            model_type="unigram", byte_fallback=True, character_coverage=1.0,
            hard_vocab_limit=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=1, minloglevel=2)
        os.replace(prefix + ".model", model_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", nargs="?", default=DEFAULT_OUTPUT,
                        help=f"where to write (default {os.path.relpath(DEFAULT_OUTPUT)})")
    parser.add_argument("--vocab-size", type=int, default=512,
                        help="SentencePiece vocabulary size (>= 300: 256 byte pieces come first)")
    parser.add_argument("--workers", type=int, default=1, help="preprocessing workers")
    args = parser.parse_args(argv)

    os.makedirs(args.output_dir, exist_ok=True)
    model_path = os.path.join(args.output_dir, "tokenizer.model")
    train_tokenizer(CORPUS, model_path, args.vocab_size)
    return tokenize_corpus(CORPUS, args.output_dir, model_path, args.workers, "quickstart data")


def tokenize_corpus(corpus: str, output_dir: str, model_path: str, workers: int,
                    what: str) -> int:
    """``corpus`` (JSON lines) tokenized into ``output_dir/corpus_text_document.{bin,idx}``;
    prints the flags that train on it; returns preprocess_data's status."""
    prefix = os.path.join(output_dir, "corpus")
    status = preprocess_data.main([
        "--input", corpus, "--output-prefix", prefix, "--json-keys", "text",
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", model_path,
        "--append-eod", "--workers", str(workers), "--log-interval", "100000"])
    if status == 0:
        print(f"{what} ready; train with:\n"
              f"  --data-path {prefix}_text_document --split 949,50,1 "
              f"--tokenizer-type Llama2Tokenizer --tokenizer-model {model_path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
