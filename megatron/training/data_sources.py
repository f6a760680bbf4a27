"""Where pretraining data comes from: ``--data-path`` or one of its alternatives (upstream's).

At most one source, as upstream: one blend cut into train/valid/test by ``--split``
(``--data-path``, or ``--data-args-path``: a file holding ``--data-path``'s words, for blends
too long for a command line), a blend per split (``--train-data-path``, ``--valid-data-path``,
``--test-data-path``, each optionally weighted, or ``--per-split-data-args-path``: a JSON file
``{"train": [...], "valid": [...], "test": [...]}`` whose values are such word lists or one
string of them), or ``--mock-data``. ``get_blend_and_blend_per_split`` gives the dataset
config's ``blend`` and ``blend_per_split``; every error is one line naming the flag.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron.core.datasets.blended_megatron_dataset_config import Blend
from megatron.core.datasets.utils import Split, get_blend_from_list

ONE_BLEND = ("--data-path", "--data-args-path")
PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


class DataSourceError(ValueError):
    """A data source that cannot be used; the message names its flag."""


def _per_split_paths(args) -> list[Optional[list[str]]]:
    return [args.train_data_path, args.valid_data_path, args.test_data_path]


def sources_given(args) -> list[str]:
    """The flags of each data source set on the command line."""
    given = []
    if args.data_path is not None or args.data_args_path is not None:
        given.append("--data-args-path" if args.data_path is None else "--data-path")
    if args.per_split_data_args_path is not None:
        given.append("--per-split-data-args-path")
    per_split = [flag for flag, paths in zip(PER_SPLIT_FLAGS, _per_split_paths(args))
                 if paths is not None]
    if per_split:
        given.append(", ".join(per_split))
    if args.mock_data:
        given.append("--mock-data")
    return given


def check_data_sources(args) -> None:
    """At most one source, given one way; raise DataSourceError naming the flags."""
    if args.data_path is not None and args.data_args_path is not None:
        raise DataSourceError("--data-path and --data-args-path are alternatives; give one")
    given = sources_given(args)
    if len(given) > 1:
        raise DataSourceError(f"give a single data source, not {' and '.join(given)}")
    if args.split is not None and given and given[0] not in ONE_BLEND + ("--mock-data",):
        raise DataSourceError(f"--split cuts one blend into train/valid/test; with {given[0]} "
                              f"each split has its own data: drop --split")


def _blend(words: Optional[list[str]], flag: str) -> Optional[Blend]:
    try:
        return get_blend_from_list(words)
    except ValueError as error:
        raise DataSourceError(f"{flag}: {error}") from None


def _read(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as error:
        raise DataSourceError(f"{flag} {path}: cannot read it "
                              f"({error.strerror or error})") from None


def _per_split_file(path: str) -> list[Optional[Blend]]:
    flag = "--per-split-data-args-path"
    try:
        entries = json.loads(_read(path, flag))
    except ValueError as error:
        raise DataSourceError(f"{flag} {path}: not JSON ({error})") from None
    names = [split.name for split in Split]
    if not isinstance(entries, dict) or set(entries) - set(names):
        found = sorted(entries) if isinstance(entries, dict) else type(entries).__name__
        raise DataSourceError(f"{flag} {path}: expected an object with keys among {names}, got "
                              f"{found}")
    blends = []
    for name in names:
        words = entries.get(name)
        if isinstance(words, str):
            words = words.split()
        if words is not None and not (isinstance(words, list)
                                      and all(isinstance(w, (str, int, float)) for w in words)):
            raise DataSourceError(f"{flag} {path}: {name!r} must be a list of prefixes (and "
                                  f"weights) or one string of them")
        blends.append(_blend(None if words is None else [str(w) for w in words],
                             f"{flag} {path} ({name})"))
    return blends


def _labelled_blends(args) -> tuple[bool, list[tuple[str, Optional[Blend]]]]:
    """Whether the data source is one blend, and each of its blends (None for a split left
    out) with the flag, and file, that named it: the label of its errors."""
    check_data_sources(args)
    if args.data_args_path is not None:
        flag = f"--data-args-path {args.data_args_path}"
        return True, [(flag, _blend(_read(args.data_args_path, "--data-args-path").split(),
                                    flag))]
    if args.data_path is not None:
        return True, [("--data-path", _blend(args.data_path, "--data-path"))]
    if args.per_split_data_args_path is not None:
        path = args.per_split_data_args_path
        flags = [f"--per-split-data-args-path {path} ({split.name})" for split in Split]
        return False, list(zip(flags, _per_split_file(path)))
    paths = _per_split_paths(args)
    if any(words is not None for words in paths):
        return False, [(flag, _blend(words, flag)) for words, flag in zip(paths, PER_SPLIT_FLAGS)]
    return False, []


def get_blend_and_blend_per_split(args) -> tuple[Optional[Blend], Optional[list[Optional[Blend]]]]:
    """``(blend, blend_per_split)`` of the data source ``args`` name; (None, None) for none."""
    one_blend, labelled = _labelled_blends(args)
    blends = [blend for _, blend in labelled]
    if one_blend:
        return blends[0], None
    return None, blends or None


def check_data_files(args) -> None:
    """Every prefix the data source names has its ``.idx`` and ``.bin``: checked when a run
    starts, before the model is built, so a wrong path ends it in one line naming the flag
    (``tools/check_args.py`` opens no file: its paths are the cluster's)."""
    labelled = [(flag, blend) for flag, blend in _labelled_blends(args)[1] if blend is not None]
    for flag, (prefixes, _) in labelled:
        for prefix in prefixes:
            if not os.path.isfile(f"{prefix}.idx"):
                raise DataSourceError(
                    f"{flag}: {prefix}.idx does not exist (a data path is the prefix of a "
                    f".bin/.idx pair, as tools/preprocess_data.py writes them, e.g. "
                    f"my-corpus_text_document)")
            if not os.path.isfile(f"{prefix}.bin"):
                raise DataSourceError(f"{flag}: {prefix}.bin does not exist beside its .idx")


def check_training_data(args, read_files: bool = True) -> None:
    """What pretraining needs of its data: one source, and the files of data arguments it
    names readable and well formed (unless ``read_files`` is False: the paths are another
    machine's)."""
    if not sources_given(args):
        raise DataSourceError("pretraining needs --data-path (or --data-args-path, per-split "
                              "--train-data-path/--valid-data-path/--test-data-path or "
                              "--per-split-data-args-path; --mock-data for synthetic data)")
    if read_files:
        get_blend_and_blend_per_split(args)
    else:
        check_data_sources(args)
    if args.num_dataset_builder_threads < 1:
        raise DataSourceError(f"--num-dataset-builder-threads must be >= 1, got "
                              f"{args.num_dataset_builder_threads}")
