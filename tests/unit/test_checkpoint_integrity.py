"""The checkpoint manifest in one process: digests, who checksums what, and each kind of damage."""

import os
import zlib

import pytest

from megatron.core.dist_checkpointing.errors import CheckpointError
from megatron.training.checkpoint.integrity import (
    MANIFEST,
    file_digest,
    list_files,
    split_by_size,
    verify_checkpoint,
    write_manifest,
    writer_rank,
)


@pytest.fixture
def checkpoint(tmp_path):
    files = {"common.pt": b"c" * 100, "model/.metadata": b"m" * 40,
             "model/__0_0.distcp": bytes(range(256)) * 40, "model/__1_0.distcp": b"x" * 5000,
             "rng/rank_00000.pt": b"r0", "rng/rank_00001.pt": b"r1"}
    for name, data in files.items():
        os.makedirs(os.path.dirname(tmp_path / name), exist_ok=True)
        (tmp_path / name).write_bytes(data)
    write_manifest(str(tmp_path))
    return tmp_path


def test_digest_is_size_and_crc32(tmp_path):
    data = os.urandom(9 << 20)  # more than one read chunk
    (tmp_path / "f").write_bytes(data)
    assert file_digest(str(tmp_path / "f")) == {"size": len(data), "crc32": zlib.crc32(data)}


@pytest.mark.parametrize("name,world_size,rank", [
    ("model/__3_0.distcp", 4, 3), ("optimizer/__1_2.distcp", 4, 1), ("rng/rank_00002.pt", 4, 2),
    ("model/__5_0.distcp", 4, 1), ("model/.metadata", 4, 0), ("common.pt", 4, 0),
    ("rank_00002.pt.bak", 4, 0)])
def test_files_are_checksummed_by_the_rank_that_wrote_them(name, world_size, rank):
    assert writer_rank(name, world_size) == rank


def test_shares_cover_every_file_once_with_about_equal_bytes():
    sizes = {"a": 100, "b": 90, "c": 60, "d": 40, "e": 5, "f": 5}
    shares = split_by_size(sizes, 2)
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    assert sorted(sum(sizes[n] for n in share) for share in shares) == [150, 150]
    assert split_by_size(sizes, 2) == shares  # every rank computes the same split
    assert [len(share) for share in split_by_size({"a": 1}, 3)] == [1, 0, 0]


def test_an_intact_checkpoint_verifies_and_the_manifest_lists_every_file(checkpoint):
    assert verify_checkpoint(str(checkpoint))
    assert MANIFEST not in list_files(str(checkpoint))
    (checkpoint / "notes.txt").write_text("added later, not listed")
    assert verify_checkpoint(str(checkpoint))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,name,message", [
    (_truncate, "model/__1_0.distcp", "has 2500 bytes, manifest.json lists 5000"),
    (_flip, "model/__0_0.distcp", "does not match its CRC-32 in manifest.json"),
    (os.remove, "rng/rank_00001.pt", "is missing (manifest.json lists it)"),
    (_flip, "common.pt", "does not match its CRC-32"),
])
def test_damage_is_named_with_the_file(checkpoint, damage, name, message):
    damage(checkpoint / name)
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(str(checkpoint))
    assert str(error.value).startswith(f"checkpoint file {checkpoint / name} ")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_several_bad_files_name_the_first_and_count_the_rest(checkpoint):
    os.remove(checkpoint / "rng/rank_00000.pt")
    os.remove(checkpoint / "rng/rank_00001.pt")
    with pytest.raises(CheckpointError, match=r"rank_00000\.pt is missing .*\(and 1 more bad"):
        verify_checkpoint(str(checkpoint))


def test_without_a_manifest_nothing_is_checked(checkpoint):
    os.remove(checkpoint / MANIFEST)
    assert verify_checkpoint(str(checkpoint)) is False


def test_a_damaged_manifest_is_named(checkpoint):
    (checkpoint / MANIFEST).write_text('{"files": {"common.pt": ')
    with pytest.raises(CheckpointError, match=f"checkpoint manifest {checkpoint / MANIFEST} is "
                                              f"unreadable or corrupt"):
        verify_checkpoint(str(checkpoint))
