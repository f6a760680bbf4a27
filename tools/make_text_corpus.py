"""Build a training corpus of real text from files already on this machine.

    python tools/make_text_corpus.py OUTPUT_DIR ROOT [ROOT ...] [--megabytes 200]

For loss-curve comparisons the quickstart corpus is too small (it is learnt in a few hundred
steps). This collects documentation and source text under the ROOTs (``.md``, ``.rst``,
``.txt`` and ``.py`` files, e.g. a Python installation's ``site-packages``: English prose of
docstrings and documents, and code), one document per file, in sorted path order, up to
``--megabytes``; trains a SentencePiece tokenizer on a sample of it (as the quickstart's, with
``--vocab-size`` pieces); and tokenizes it with ``tools/preprocess_data.py``. OUTPUT_DIR then
holds ``tokenizer.model`` and ``corpus_text_document.bin`` / ``.idx``; the flags to train on
them are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from make_quickstart_data import tokenize_corpus, train_tokenizer

SUFFIXES = (".md", ".rst", ".txt", ".py")
SKIPPED_PARTS = {"__pycache__", ".git", "tests", "test"}


def text_files(roots: list[str]):
    for root in roots:
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_PARTS)
            for name in sorted(files):
                if name.endswith(SUFFIXES):
                    yield os.path.join(folder, name)


def write_corpus(roots: list[str], path: str, limit_bytes: int) -> tuple[int, int]:
    """One JSON line per readable, non-empty file until ``limit_bytes`` of text; returns
    (documents, bytes)."""
    documents = written = 0
    with open(path, "w", encoding="utf-8") as out:
        for file in text_files(roots):
            try:
                with open(file, encoding="utf-8") as stream:
                    text = stream.read()
            except (OSError, UnicodeDecodeError):
                continue
            if len(text.strip()) < 200:
                continue
            out.write(json.dumps({"text": text}) + "\n")
            documents += 1
            written += len(text.encode("utf-8"))
            if written >= limit_bytes:
                break
    return documents, written


def write_sample(corpus: str, sample: str, limit_bytes: int) -> None:
    """The corpus's documents spread evenly, up to ``limit_bytes``, for the tokenizer."""
    with open(corpus, encoding="utf-8") as stream:
        lines = stream.readlines()
    total = sum(len(line) for line in lines)
    stride = max(1, round(total / max(limit_bytes, 1)))
    with open(sample, "w", encoding="utf-8") as out:
        out.writelines(lines[::stride])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("roots", nargs="+", help="folders to collect text from")
    parser.add_argument("--megabytes", type=float, default=200.0, help="corpus size")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer-sample-megabytes", type=float, default=20.0,
                        help="how much of the corpus the tokenizer is trained on")
    parser.add_argument("--workers", type=int, default=4, help="preprocessing workers")
    args = parser.parse_args(argv)
    missing = [root for root in args.roots if not os.path.isdir(root)]
    if missing:
        parser.error(f"not a folder: {', '.join(missing)}")

    os.makedirs(args.output_dir, exist_ok=True)
    corpus = os.path.join(args.output_dir, "corpus.jsonl")
    documents, size = write_corpus(args.roots, corpus, int(args.megabytes * 2**20))
    if documents == 0:
        print(f"make_text_corpus: no text files under {', '.join(args.roots)}", file=sys.stderr)
        return 1
    print(f"{documents} documents, {size / 2**20:.1f} MB of text", flush=True)
    sample = os.path.join(args.output_dir, "tokenizer_sample.jsonl")
    write_sample(corpus, sample, int(args.tokenizer_sample_megabytes * 2**20))
    model_path = os.path.join(args.output_dir, "tokenizer.model")
    train_tokenizer(sample, model_path, args.vocab_size)
    return tokenize_corpus(corpus, args.output_dir, model_path, args.workers, "corpus")


if __name__ == "__main__":
    sys.exit(main())
