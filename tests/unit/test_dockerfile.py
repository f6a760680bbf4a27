"""The Dockerfile, without a Docker engine: it lints clean, copies what exists and what the
examples need, and installs nothing that would replace the base image's torch."""

import fnmatch
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def dockerfile():
    # Imported here so that collecting the suite (pytest -m cuda on a GPU machine without the
    # CPU-only test dependencies) never fails on it; only the tests that parse it skip.
    parser_module = pytest.importorskip("dockerfile_parse")
    parser = parser_module.DockerfileParser(path=os.path.join(REPO, "Dockerfile"))
    return parser


def ignored_patterns():
    with open(os.path.join(REPO, ".dockerignore")) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def is_ignored(path: str) -> bool:
    return any(fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/")
               for pattern in ignored_patterns())


def copied_sources(dockerfile) -> list[str]:
    sources = []
    for instruction in dockerfile.structure:
        if instruction["instruction"] == "COPY":
            sources += instruction["value"].split()[:-1]
    return sources


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or os.path.join(os.path.dirname(os.sys.executable),
                                                        "hadolint")
    result = subprocess.run([hadolint, os.path.join(REPO, "Dockerfile")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_copied_path_exists_and_is_not_dockerignored(dockerfile):
    sources = copied_sources(dockerfile)
    assert sources
    for source in sources:
        assert os.path.exists(os.path.join(REPO, source)), source
        assert not is_ignored(source), source


def test_the_examples_and_their_inputs_are_in_the_image(dockerfile):
    sources = copied_sources(dockerfile)
    needed = ["pretrain_gpt.py", "examples/gpt3_7b/train_gpt3_7b_pp4.sh",
              "examples/gpt3_7b/train_gpt3_7b_pp2_vpp2.sh", "examples/gpt3_7b/common.sh",
              "examples/quickstart/run.sh", "tools/make_quickstart_data.py",
              "tools/preprocess_data.py", "megatron/core/pipeline_parallel/schedules.py",
              "setup.py"]
    for path in needed:
        assert os.path.isfile(os.path.join(REPO, path)), path
        assert any(path == s or path.startswith(s.rstrip("/") + "/") for s in sources), path
        assert not is_ignored(path), path


def test_nothing_installed_replaces_the_base_images_torch(dockerfile):
    installs = [segment.split("pip install", 1)[1].split()
                for instruction in dockerfile.structure if instruction["instruction"] == "RUN"
                for segment in instruction["value"].split("&&") if "pip install" in segment]
    assert installs
    for words in installs:
        requirements = [w.strip('"') for w in words if not w.startswith("-")]
        assert not any(r.startswith("torch") for r in requirements), words
        if "." in requirements:  # this package itself: its dependencies must not be resolved
            assert "--no-deps" in words
    # The base is a build argument whose default is the image the README recommends.
    assert "FROM ${BASE_IMAGE}" in dockerfile.content
    assert dockerfile.baseimage == "nvcr.io/nvidia/pytorch:25.09-py3"
