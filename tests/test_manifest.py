"""Folder manifests: each kind of damage is named in one line, a clean folder verifies."""

from __future__ import annotations

import json

import pytest

from parallel3d.manifest import MANIFEST, ManifestMissing, hash_of, read_manifest, verify_manifest, write_manifest
import parallel3d.manifest as manifest_module


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
    monkeypatch.setattr(manifest_module, "BLOCK", 7)  # the manifest's own block size decides the check
    data = bytearray((tmp_path / "big.bin").read_bytes())
    data[2100] ^= 1
    (tmp_path / "big.bin").write_bytes(bytes(data))
    assert "big.bin: checksum mismatch in bytes 2000..2560" in verify_manifest(tmp_path, "checksum")


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
