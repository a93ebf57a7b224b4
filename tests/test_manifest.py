"""Folder manifests: each kind of damage is named in one line, a clean folder verifies."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

import parallel3d.checkpoint.manifest as manifest_module
from parallel3d.checkpoint.manifest import (MANIFEST, ManifestMissing, file_entries, hash_of, read_manifest,
                                            verify_manifest, write_manifest)


def folder_with_manifest(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 100)
    (tmp_path / "sub" / "b.bin").write_bytes(b"x" * 10)
    write_manifest(tmp_path, [tmp_path / "a.bin", "sub/b.bin"])
    return tmp_path


def test_a_clean_folder_verifies_in_every_mode(tmp_path):
    folder = folder_with_manifest(tmp_path)
    manifest = read_manifest(folder)
    assert set(manifest["files"]) == {"a.bin", "sub/b.bin"}
    assert manifest["files"]["a.bin"]["size"] == 25600
    assert manifest["checksum"] == "xxh3_64" and manifest["files"]["a.bin"]["xxh3_64"] == [hash_of(folder / "a.bin")]
    for mode in ("checksum", "size", "none"):
        assert verify_manifest(folder, mode) is None
    with pytest.raises(ValueError, match="verify mode"):
        verify_manifest(folder, "sha")


@pytest.mark.fast
def test_each_kind_of_damage_is_named(tmp_path):
    folder = folder_with_manifest(tmp_path)
    data = bytearray((folder / "a.bin").read_bytes())
    data[1000] ^= 0xFF  # a flipped byte: same size, so only the checksum sees it
    (folder / "a.bin").write_bytes(bytes(data))
    assert verify_manifest(folder, "size") is None
    assert verify_manifest(folder, "checksum") == (f"{folder / 'a.bin'}: checksum mismatch in bytes 0..25600 "
                                                   f"(xxh3_64 {hash_of(folder / 'a.bin')}, manifest "
                                                   f"{read_manifest(folder)['files']['a.bin']['xxh3_64'][0]})")
    (folder / "a.bin").write_bytes(bytes(data[:-5]))
    assert verify_manifest(folder, "size") == f"{folder / 'a.bin'}: size 25595 != 25600 in the manifest (truncated)"
    (folder / "a.bin").unlink()
    assert verify_manifest(folder, "size") == f"{folder / 'a.bin'} is missing"


def test_large_files_hash_in_blocks_and_a_flip_names_its_block(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest_module, "BLOCK", 1000)
    (tmp_path / "big.bin").write_bytes(bytes(range(256)) * 10)  # 2560 bytes: blocks of 1000, 1000, 560
    write_manifest(tmp_path, ["big.bin"])
    hashes = read_manifest(tmp_path)["files"]["big.bin"]["xxh3_64"]
    assert hashes == [hash_of(tmp_path / "big.bin", start, 1000) for start in (0, 1000, 2000)]
    data = bytearray((tmp_path / "big.bin").read_bytes())
    data[2100] ^= 1
    (tmp_path / "big.bin").write_bytes(bytes(data))
    assert "big.bin: checksum mismatch in bytes 2000..2560" in verify_manifest(tmp_path, "checksum")
    monkeypatch.setattr(manifest_module, "BLOCK", 7)  # a block size other than the writer's: not taken
    assert verify_manifest(tmp_path, "size") == (f"{tmp_path / MANIFEST} is unreadable (block_bytes 1000: this "
                                                 f"version writes 7)")


def test_unlisted_files_fail_unless_ignored(tmp_path):
    folder = folder_with_manifest(tmp_path)
    (folder / "COMPLETE").write_text("")
    assert verify_manifest(folder, "size") == f"{folder / 'COMPLETE'} is not in the manifest"
    assert verify_manifest(folder, "size", ignore=["COMPLETE"]) is None
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["files"]["sub/b.bin"]  # an entry lost from the manifest
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert verify_manifest(folder, "checksum", ignore=["COMPLETE"]) == f"{folder / 'sub/b.bin'} is not in the manifest"


def test_a_missing_or_corrupt_manifest(tmp_path):
    folder = folder_with_manifest(tmp_path)
    (folder / MANIFEST).write_text('{"files": {')
    assert verify_manifest(folder, "size").startswith(f"{folder / MANIFEST} is unreadable")
    (folder / MANIFEST).unlink()
    with pytest.raises(ManifestMissing):
        verify_manifest(folder, "checksum")
    assert verify_manifest(folder, "none") is None


def test_entries_hashed_elsewhere_are_taken_as_they_are(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"a" * 10)
    (tmp_path / "b.bin").write_bytes(b"b" * 10)
    entries = file_entries(tmp_path, ["a.bin"])  # a rank that wrote a.bin hashed it
    assert write_manifest(tmp_path, [tmp_path / "a.bin", tmp_path / "b.bin"], entries=entries)["files"] == \
        entries | file_entries(tmp_path, ["b.bin"])
    assert verify_manifest(tmp_path, "checksum") is None


def _verify_on_two_ranks(folder, monkeypatch) -> tuple[dict, dict]:
    """verify_manifest on two gloo ranks (threads of this process, a store in memory): each rank's
    answer, and the (file, offset) blocks each rank hashed."""
    store, answers, hashed = dist.HashStore(), {}, {"0": [], "1": []}
    hash_blocks = manifest_module._hash_blocks

    def counted(folder, blocks, block):
        hashed.setdefault(threading.current_thread().name, []).extend(blocks)
        return hash_blocks(folder, blocks, block)

    def rank_verifies(rank: int) -> None:
        group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
        answers[rank] = verify_manifest(folder, "checksum", group=group)

    monkeypatch.setattr(manifest_module, "_hash_blocks", counted)
    threads = [threading.Thread(target=rank_verifies, args=(rank,), name=str(rank)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return answers, hashed


@pytest.mark.fast
def test_ranks_split_the_verification_and_agree_on_the_first_problem(tmp_path, monkeypatch):
    """Each block is read by one rank only, and both ranks answer what one process would."""
    monkeypatch.setattr(manifest_module, "BLOCK", 1000)
    (tmp_path / "big.bin").write_bytes(bytes(range(256)) * 10)  # blocks at 0, 1000, 2000
    (tmp_path / "small.bin").write_bytes(b"x" * 10)
    write_manifest(tmp_path, ["big.bin", "small.bin"])
    answers, hashed = _verify_on_two_ranks(tmp_path, monkeypatch)
    assert answers == {0: None, 1: None}
    assert hashed["0"] and hashed["1"] and not set(hashed["0"]) & set(hashed["1"])
    assert sorted(hashed["0"] + hashed["1"]) == [("big.bin", 0), ("big.bin", 1000), ("big.bin", 2000), ("small.bin", 0)]
    for flipped in (2100, 1100):  # the second block goes to the other rank than the third
        data = bytearray((tmp_path / "big.bin").read_bytes())
        data[flipped] ^= 1
        (tmp_path / "big.bin").write_bytes(bytes(data))
        alone = verify_manifest(tmp_path, "checksum")
        assert f"big.bin: checksum mismatch in bytes {flipped // 1000 * 1000}.." in alone
        assert _verify_on_two_ranks(tmp_path, monkeypatch)[0] == {0: alone, 1: alone}


def _hostile(folder, edit) -> str | None:
    """``folder``'s manifest changed by ``edit`` (a function of the parsed manifest), then verified."""
    manifest = json.loads((folder / MANIFEST).read_text())
    edit(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    return verify_manifest(folder, "checksum")


HOSTILE = {  # case: (edit of the manifest, what the line says)
    "tiny blocks": (lambda m: m.update(block_bytes=1), "block_bytes 1: this version writes"),
    "no block size": (lambda m: m.pop("block_bytes"), "block_bytes None"),
    "zero block size": (lambda m: m.update(block_bytes=0), "block_bytes 0"),
    "block size as text": (lambda m: m.update(block_bytes=str(m["block_bytes"])), "block_bytes '"),
    "another format": (lambda m: m.update(format=99), "format 99"),
    "another checksum": (lambda m: m.update(checksum="md5"), "checksum 'md5'"),
    "a null entry": (lambda m: m["files"].update({"a.bin": None}), "entry 'a.bin' has no size"),
    "no size": (lambda m: m["files"]["a.bin"].pop("size"), "entry 'a.bin' has no size"),
    "size as text": (lambda m: m["files"]["a.bin"].update(size="25600"), "entry 'a.bin' has no size"),
    "negative size": (lambda m: m["files"]["a.bin"].update(size=-1), "entry 'a.bin' has no size"),
    "no hashes": (lambda m: m["files"]["a.bin"].pop("xxh3_64"), "does not have one xxh3_64 hash per"),
    "too many hashes": (lambda m: m["files"]["a.bin"]["xxh3_64"].append("0"), "does not have one xxh3_64 hash"),
    "not an object": (lambda m: m.update(files=[]), "has no files table"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_manifest_is_unreadable_in_one_line(tmp_path, case):
    edit, said = HOSTILE[case]
    line = _hostile(folder_with_manifest(tmp_path), edit)
    assert line.startswith(f"{tmp_path / MANIFEST} is unreadable (") and said in line, line


def test_a_manifest_naming_files_outside_its_folder_reads_none_of_them(tmp_path, monkeypatch):
    """A path that climbs out, an absolute one, a link to outside: each with its true hash, and
    still refused before anything is hashed."""
    (tmp_path / "folder").mkdir()
    folder, outside = folder_with_manifest(tmp_path / "folder"), tmp_path / "secret.bin"
    outside.write_bytes(b"secret" * 100)
    (folder / "link.bin").symlink_to(outside)
    true_entry = file_entries(tmp_path, [outside])["secret.bin"]
    hashed = []
    monkeypatch.setattr(manifest_module, "_hash_blocks", lambda folder, blocks, block: hashed.extend(blocks) or [])
    for name in ("../secret.bin", str(outside), "sub/../../secret.bin", "link.bin"):
        line = _hostile(folder, lambda m: m["files"].update({name: true_entry}))
        assert line == f"{folder / MANIFEST} is unreadable (entry {name!r} names a file outside the folder)", line
        manifest = json.loads((folder / MANIFEST).read_text())
        del manifest["files"][name]
        (folder / MANIFEST).write_text(json.dumps(manifest))
    assert hashed == []


def test_a_huge_or_binary_manifest_is_unreadable_at_once(tmp_path, monkeypatch):
    folder = folder_with_manifest(tmp_path)
    (folder / MANIFEST).write_bytes(b"\xff\xfe" * 10)
    assert "is unreadable (not UTF-8" in verify_manifest(folder, "size")
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 10)
    assert "more than any manifest this version writes" in verify_manifest(folder, "size")
