"""A checkpoint's manifest: every file with its size and CRC-32, written at save, checked at load.

torch.distributed.checkpoint stores raw tensor bytes without checksums, so a shard cut short by
a full disk or changed by bad storage would load silently. Each rank checksums the files it
wrote (``digests_of_my_files``), while they are still in its page cache, and rank 0 writes
``manifest.json`` from everyone's (``write_manifest``, collective, or ``save_job``, which hands
them over in files); the checkpoint is renamed into place only after that.
``verify_checkpoint`` (collective, before anything is read) splits the listed files across the
ranks by size, each rank checks the size and checksum of its share, and every rank raises the
same one-line CheckpointError naming the first bad file. Nothing here knows the
layout of a checkpoint: whatever directories and files it holds are listed and checked.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Optional

import torch.distributed as dist

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.core.dist_checkpointing.ranks import from_every_rank

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK_BYTES = 4 << 20
# Files whose name carries the rank that wrote them: DCP's ``__<rank>_<n>.distcp`` and our
# ``rank_<rank>.pt``. Others (DCP's ``.metadata``, ``common.pt``) come from rank 0.
_WRITER_IN_NAME = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")


def file_digest(path: str) -> dict[str, int]:
    """Size and CRC-32 of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": crc}


def list_files(directory: str) -> list[str]:
    """Every file under ``directory`` but the manifest, as sorted '/'-separated relative paths."""
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            if relative != MANIFEST:
                found.append(relative)
    return sorted(found)


def writer_rank(relative: str, world_size: int) -> int:
    """The rank that wrote ``relative`` and so checksums it at save (rank 0 when unnamed)."""
    match = _WRITER_IN_NAME.search(relative)
    if match is None:
        return 0
    return int(match.group(1) or match.group(2)) % world_size


def split_by_size(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """Files dealt into ``parts`` shares of about equal bytes, the largest first to the lightest
    share; the same on every rank for the same input."""
    shares: list[list[str]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lightest = loads.index(min(loads))
        shares[lightest].append(name)
        loads[lightest] += sizes[name]
    return shares


def _rank_and_size() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def digests_of_my_files(directory: str, rank: int, world_size: int,
                        skip: Optional[str] = None) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the files of ``directory`` that ``rank`` wrote (but those under the
    folder ``skip``)."""
    return {name: file_digest(os.path.join(directory, name)) for name in list_files(directory)
            if writer_rank(name, world_size) == rank
            and not (skip and name.startswith(skip + "/"))}


def write_manifest_file(directory: str, files: dict[str, dict[str, int]]) -> None:
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"version": MANIFEST_VERSION, "files": dict(sorted(files.items()))}, f,
                  indent=1)


def write_manifest(directory: str) -> None:
    """Record every file of ``directory`` in its manifest (collective; call once every rank has
    written its files)."""
    rank, world_size = _rank_and_size()
    mine = digests_of_my_files(directory, rank, world_size)
    everyone: list[Optional[dict]] = [mine]
    if world_size > 1:
        everyone = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
    if rank == 0:
        write_manifest_file(directory, {name: digest for share in everyone
                                        for name, digest in share.items()})


def read_manifest(directory: str) -> Optional[dict[str, dict[str, int]]]:
    """The files a manifest lists, or None where the checkpoint has no manifest."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return dict(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint manifest {path} is unreadable or corrupt "
                              f"({type(error).__name__}: {error})") from None


def check_file(directory: str, name: str, expected: dict[str, int]) -> Optional[str]:
    """What is wrong with one listed file (its size, then its checksum), or None."""
    path = os.path.join(directory, name)
    try:
        size = os.path.getsize(path)
        if size != expected["size"]:
            return (f"checkpoint file {path} has {size} bytes, {MANIFEST} lists "
                    f"{expected['size']}: it is truncated or was overwritten")
        if file_digest(path)["crc32"] != expected["crc32"]:
            return (f"checkpoint file {path} does not match its CRC-32 in {MANIFEST}: its bytes "
                    f"changed after it was saved")
    except FileNotFoundError:
        return f"checkpoint file {path} is missing ({MANIFEST} lists it)"
    except OSError as error:
        return f"checkpoint file {path} cannot be read ({error.strerror or error})"
    return None


def verify_checkpoint(directory: str) -> bool:
    """Check every file the manifest of ``directory`` lists (collective; each rank checks a
    share). Raise CheckpointError naming the first bad file on every rank; return False where
    there is no manifest to check against."""
    files = read_manifest(directory)
    if files is None:
        return False
    rank, world_size = _rank_and_size()
    share = split_by_size({name: entry["size"] for name, entry in files.items()},
                          world_size)[rank]
    problems = {name: problem for name in share
                if (problem := check_file(directory, name, files[name]))}
    found = {name: problem for share_problems in from_every_rank(problems) for name, problem in
             share_problems.items()}
    if found:
        more = f" (and {len(found) - 1} more bad files)" if len(found) > 1 else ""
        raise CheckpointError(found[min(found)] + more)
    return True
