"""tools/preprocess_data.py and tools/make_quickstart_data.py: outputs, progress, bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def load_tool(name: str):
    """Import tools/<name>.py as module ``name`` (the tools are scripts, not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


preprocess_data = load_tool("preprocess_data")
make_quickstart_data = load_tool("make_quickstart_data")


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join((json.dumps(record) if not isinstance(record, str) else record)
                            + "\n" for record in records))
    return str(path)


def null_args(input_path: str, prefix: str, *extra: str) -> list[str]:
    return ["--input", input_path, "--output-prefix", prefix, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", "--workers", "2", *extra]


def test_documents_keys_and_eod(tmp_path, capsys):
    records = [{"text": "1 2 3", "title": "7"}, {"text": ["4 5", "", "6"], "title": "8 9"},
               {"text": "", "title": "1"}, "   ", {"text": "10", "title": "11"}]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    prefix = str(tmp_path / "out" / "corpus")
    status = preprocess_data.main(null_args(source, prefix, "--json-keys", "text", "title",
                                            "--append-eod", "--log-interval", "1"))
    assert status == 0
    text = IndexedDataset(prefix + "_text_document")
    assert [text[i].tolist() for i in range(len(text))] == [[1, 2, 3, 1000], [4, 5], [6, 1000],
                                                           [10, 1000]]
    # The blank line is skipped; the empty document stays a document without sequences.
    assert text.document_indices.tolist() == [0, 1, 3, 3, 4]
    assert text.index.dtype == numpy.uint16
    title = IndexedDataset(prefix + "_title_document")
    assert [title[i].tolist() for i in range(len(title))] == [[7, 1000], [8, 9, 1000], [1, 1000],
                                                             [11, 1000]]
    assert sorted(os.listdir(tmp_path / "out")) == [
        "corpus_text_document.bin", "corpus_text_document.idx",
        "corpus_title_document.bin", "corpus_title_document.idx"]
    err = capsys.readouterr().err
    assert re.search(r"Processed \d+ documents \([\d.]+ docs/s, [\d.]+ MB/s\)\.", err), err
    assert "Done: 4 documents" in err


def test_output_does_not_depend_on_the_worker_count(tmp_path):
    rng = numpy.random.default_rng(0)
    records = [{"text": " ".join(map(str, rng.integers(0, 1000, size=int(rng.integers(0, 30)))))}
               for _ in range(2000)]  # several batches, some documents empty
    source = write_jsonl(tmp_path / "in.jsonl", records)
    outputs = []
    for workers in ("1", "3"):
        prefix = str(tmp_path / f"w{workers}")
        argv = null_args(source, prefix, "--append-eod")
        argv[argv.index("--workers") + 1] = workers
        assert preprocess_data.main(argv) == 0
        outputs.append([Path(prefix + "_text_document" + suffix).read_bytes()
                        for suffix in (".bin", ".idx")])
    assert outputs[0] == outputs[1]


def test_large_vocabulary_uses_int32(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "69999 3"}])
    prefix = str(tmp_path / "big")
    argv = null_args(source, prefix)
    argv[argv.index("1000")] = "70000"
    assert preprocess_data.main(argv) == 0
    dataset = IndexedDataset(prefix + "_text_document")
    assert dataset.index.dtype == numpy.int32 and dataset[0].tolist() == [69999, 3]


def test_sentencepiece_tokens_match_the_tokenizer(tmp_path):
    model = tmp_path / "tokenizer.model"
    make_quickstart_data.train_tokenizer(make_quickstart_data.CORPUS, str(model), 400)
    texts = ["Ada walked to the river.", "Three plus four is seven. 3 + 4 = 7.", "naïve ✓"]
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": text} for text in texts])
    prefix = str(tmp_path / "sp")
    assert preprocess_data.main([
        "--input", source, "--output-prefix", prefix, "--tokenizer-type", "Llama2Tokenizer",
        "--tokenizer-model", str(model), "--append-eod", "--workers", "1"]) == 0
    import sentencepiece
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    dataset = IndexedDataset(prefix + "_text_document")
    for index, text in enumerate(texts):
        assert dataset[index].tolist() == [1] + processor.encode(text) + [2]


@pytest.mark.parametrize("line, message", [
    ('{"text": "1 2"', r"line 2: not valid JSON \(Expecting ',' delimiter"),
    ('{"body": "1 2"}', r"line 2: no key 'text' \(keys present: 'body'\); choose the keys "
                        r"with --json-keys"),
    ('{"text": 5}', r"line 2: key 'text' must hold a string or a list of strings, got int"),
    ('[1, 2]', r"line 2: expected a JSON object, got list"),
    ('{"text": "1 5000"}', r"token id 5000 is outside the vocabulary"),
])
def test_bad_lines_are_reported_and_nothing_is_written(tmp_path, capsys, line, message):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}, line, {"text": "2"}])
    prefix = str(tmp_path / "out")
    assert preprocess_data.main(null_args(source, prefix)) == 1
    err = capsys.readouterr().err
    assert "preprocess_data.py: error:" in err
    assert re.search(message, err), err
    assert [name for name in os.listdir(tmp_path) if name != "in.jsonl"] == []


def test_a_failed_run_keeps_the_previous_output(tmp_path):
    prefix = str(tmp_path / "out")
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "1 2"}])
    assert preprocess_data.main(null_args(good, prefix)) == 0
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "3"}, "{oops"])
    assert preprocess_data.main(null_args(bad, prefix)) == 1
    assert IndexedDataset(prefix + "_text_document")[0].tolist() == [1, 2]


@pytest.mark.parametrize("extra, message", [
    (["--split-sentences"], "--split-sentences is not supported"),
    (["--partitions", "2"], "--partitions 2 is not supported"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--json-keys", "text", "text"], "names a key twice"),
])
def test_rejected_flags(tmp_path, capsys, extra, message):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}])
    with pytest.raises(SystemExit):
        preprocess_data.get_args(null_args(source, str(tmp_path / "o")) + extra)
    assert message in capsys.readouterr().err


def test_missing_input_and_tokenizer_files(tmp_path, capsys):
    with pytest.raises(SystemExit):
        preprocess_data.get_args(null_args(str(tmp_path / "none.jsonl"), str(tmp_path / "o")))
    assert "none.jsonl: no such file" in capsys.readouterr().err
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}])
    status = preprocess_data.main(["--input", source, "--output-prefix", str(tmp_path / "o"),
                                   "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                                   str(tmp_path / "none.model"), "--workers", "1"])
    assert status == 1
    assert "--tokenizer-model" in capsys.readouterr().err


def _start_long_run(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    line = json.dumps({"text": " ".join(str(i) for i in range(40))}) + "\n"
    (tmp_path / "long.jsonl").write_text(line * 300_000)
    prefix = str(tmp_path / "long")
    process = subprocess.Popen(
        [sys.executable, str(TOOLS / "preprocess_data.py"),
         *null_args(str(tmp_path / "long.jsonl"), prefix)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not any(".bin.tmp-" in name for name in os.listdir(tmp_path)):
        if process.poll() is not None or time.time() > deadline:
            raise AssertionError(f"preprocessing did not start: {process.communicate()}")
        time.sleep(0.01)
    time.sleep(0.5)
    return process, prefix


def test_interrupted_run_cleans_up(tmp_path):
    process, _ = _start_long_run(tmp_path)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "interrupted; no output was written" in err
    assert sorted(os.listdir(tmp_path)) == ["long.jsonl"]


def test_killed_run_leaves_no_valid_looking_index(tmp_path):
    process, prefix = _start_long_run(tmp_path)
    process.kill()
    _, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, f"the run ended before the kill: {err}"
    names = sorted(os.listdir(tmp_path))
    assert not os.path.exists(prefix + "_text_document.idx"), names
    assert not os.path.exists(prefix + "_text_document.bin"), names
    assert all(".tmp-" in name for name in names if name != "long.jsonl"), names


def test_make_quickstart_data(tmp_path, capsys):
    assert make_quickstart_data.main([str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["corpus_text_document.bin",
                                            "corpus_text_document.idx", "tokenizer.model"]
    dataset = IndexedDataset(str(tmp_path / "corpus_text_document"))
    lines = (ROOT / "examples" / "quickstart" / "data" / "corpus.jsonl").read_text().splitlines()
    assert len(dataset) == len(lines)
    for index in (0, len(dataset) - 1):
        assert dataset[index][0] == 1 and dataset[index][-1] == 2  # Llama 2: bos ... eos
    assert int(max(dataset[i].max() for i in range(len(dataset)))) < 512
    assert "--tokenizer-type Llama2Tokenizer" in capsys.readouterr().out
