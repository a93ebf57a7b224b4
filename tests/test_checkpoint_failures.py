"""Damaged checkpoints, divergence and full disks: real torchrun jobs on CPU/gloo.

One 2-rank run saves steps 2 and 4; each fault case damages a copy of its step_4. The resume must
fall back to step_2, name the damaged file, and train steps 3-4 exactly as the run that never
stopped. The fallback cases train in one batched launch (tests/harness/layout_batch.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.runs import FAST, Run, launch, launch_batch
from harness.shared_runs import shared_runs
from safetensors.torch import load_file

from parallel3d.base import RunError
from parallel3d.checkpoint.checkpointer import Checkpointer
from parallel3d.checkpoint.commit import COMPLETE, complete_steps
from parallel3d.checkpoint.errors import CheckpointError, NonFiniteState, checkpoint_errors
from parallel3d.checkpoint.manifest import MANIFEST, file_entries, read_manifest
from parallel3d.checkpoint.resume import pick_checkpoint, verify_init_from
from parallel3d.checkpoint.state import TrainState
from parallel3d.checkpoint.verify import checkpoint_problem
from parallel3d.config.schema import CheckpointConfig, ModelConfig
from parallel3d.models import Transformer
from parallel3d.runtime.failures import report_failure

SAVING = [*FAST, "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0", "parallel.dp_shard=2"]


def _shard(step_dir: Path, rank: int) -> Path:
    return next(step_dir.glob(f"shard-{rank + 1:05d}-*.safetensors"))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x55
    path.write_bytes(bytes(data))


def _drop_manifest_entry(step_dir: Path) -> None:
    manifest = json.loads((step_dir / MANIFEST).read_text())
    del manifest["files"][_shard(step_dir, 0).name]
    (step_dir / MANIFEST).write_text(json.dumps(manifest))


def _edit_manifest(d: Path, **changes) -> None:
    manifest = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps({**manifest, **changes}))


# case: (damage to step_4, the damaged file, what the one line says about it)
FAULTS = {
    "rank0-shard-deleted": (lambda d: _shard(d, 0).unlink(), lambda d: "shard-00001-", "is missing"),
    "rank1-shard-deleted": (lambda d: _shard(d, 1).unlink(), lambda d: "shard-00002-", "is missing"),
    "shard-truncated": (lambda d: _shard(d, 1).write_bytes(_shard(d, 1).read_bytes()[:-100]),
                        lambda d: _shard(d, 1).name, "size"),
    "shard-bytes-flipped": (lambda d: _flip(_shard(d, 0), _shard(d, 0).stat().st_size // 2),
                            lambda d: _shard(d, 0).name, "checksum mismatch"),
    # This layout keeps DCP's metadata (each tensor's offsets) in each safetensors header, not .metadata.
    "shard-header-flipped": (lambda d: _flip(_shard(d, 1), 40), lambda d: _shard(d, 1).name, "checksum mismatch"),
    "meta-json-flipped": (lambda d: _flip(d / "meta.json", 5), lambda d: "meta.json", "checksum mismatch"),
    "manifest-entry-missing": (_drop_manifest_entry, lambda d: _shard(d, 0).name, "is not in the manifest"),
    # Issue 33's battery: the structure at every level, hostile manifests, a damaged saved config.
    "rank0-shard-and-manifest-deleted": (lambda d: (_shard(d, 0).unlink(), (d / MANIFEST).unlink()),
                                         lambda d: "shard-00001-", "is missing: rank 0's shard"),
    "verify-none-rank0-shard-deleted": (lambda d: _shard(d, 0).unlink(), lambda d: "shard-00001-",
                                        "is missing: rank 0's shard"),
    "manifest-tiny-blocks": (lambda d: _edit_manifest(d, block_bytes=1), lambda d: MANIFEST, "is unreadable"),
    "manifest-names-a-file-outside": (lambda d: _name_outside(d), lambda d: MANIFEST, "names a file outside"),
    "config-yaml-garbled": (lambda d: (d / "config.yaml").write_text("model: [\n"), lambda d: "config.yaml",
                            "config.yaml: size"),
    "every-complete-gone": (lambda d: (_flip(_shard(d, 0), _shard(d, 0).stat().st_size // 2),
                                       *((d.parent / f"step_{s}" / COMPLETE).unlink() for s in (2, 4))),
                            lambda d: str(d), "does not verify"),
}
OVERRIDES = {"verify-none-rank0-shard-deleted": ["checkpoint.verify=none"]}
SAID_BY = {"every-complete-gone": "has no COMPLETE marker"}  # the line's mark, else "skipping corrupt checkpoint"


def _name_outside(step_dir: Path) -> None:
    """A manifest entry for a real file outside the folder, with its true size and hashes."""
    outside = step_dir.parent.parent / "outside.bin"
    outside.write_bytes(b"x" * 1000)
    entry = file_entries(outside.parent, [outside])[outside.name]
    _edit_manifest(step_dir, files={**json.loads((step_dir / MANIFEST).read_text())["files"], "../../outside.bin": entry})


# Trained in one 2-rank launch with other files' 2-rank runs (tests/harness/shared_runs.py).
SHARED = {"saved": (2, SAVING)}


@pytest.fixture(scope="module")
def saved(run_store, request) -> Run:
    """The 2-rank run every case damages a copy of (the store's: read-only here)."""
    run = shared_runs(run_store, request.session, request.module)["saved"]
    run.assert_finished(4)
    assert complete_steps(run.run_dir / "checkpoints") == [2, 4]
    return run


def damaged_copy(saved: Run, root: Path, name: str, copy: str | None = None) -> tuple[Path, str]:
    """A copy of the saved run in ``root`` with step_4 damaged as FAULTS[name] says; (run_dir, damaged file name)."""
    damage, damaged_file, _ = FAULTS[name]
    run_dir = root / (copy or name)
    shutil.copytree(saved.run_dir, run_dir)
    step4 = run_dir / "checkpoints" / "step_4"
    damaged = damaged_file(step4)
    damage(step4)
    return run_dir, damaged


@pytest.fixture(scope="module")
def fallbacks(saved, runs_root) -> dict[str, Run]:
    """Every fault case resumed (checkpoint.resume=auto) in one 2-rank launch."""
    root = runs_root / "faults"
    root.mkdir()
    damaged = {name: damaged_copy(saved, root, name) for name in FAULTS}
    runs = launch_batch(root, {name: [*SAVING, *OVERRIDES.get(name, [])] for name in FAULTS}, nproc=2)
    for name, (run_dir, _) in damaged.items():  # a case the batch did not finish gets a launch of its own
        if name not in runs:
            runs[name] = launch(run_dir, [*SAVING, *OVERRIDES.get(name, [])], nproc=2)
        runs[name].damaged = damaged[name][1]
    return runs


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(FAULTS))
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(saved, fallbacks, name):
    run = fallbacks[name]
    run.assert_finished(4)
    step4 = run.run_dir / "checkpoints" / "step_4"
    said = [line for line in run.stderr.splitlines() if SAID_BY.get(name, "skipping corrupt checkpoint") in line]
    assert len(said) == 1 and run.damaged in said[0] and FAULTS[name][2] in said[0], run.stderr[-2000:]
    assert f"resumed from {step4.parent / 'step_2'}" in run.stdout
    # steps 3-4 as the uninterrupted run trained them from step_2, and step_4 saved whole again
    assert [row["step"] for row in run.metrics] == [1, 2, 3, 4]
    assert run.losses == saved.losses
    assert [r["grad_norm"] for r in run.metrics] == [r["grad_norm"] for r in saved.metrics]
    assert checkpoint_problem(step4) is None
    for r in (0, 1):
        assert load_file(str(_shard(step4, r))).keys() == load_file(str(_shard(saved.run_dir / "checkpoints/step_4",
                                                                               r))).keys()


@pytest.mark.multirank
def test_an_explicit_resume_of_a_damaged_checkpoint_is_refused_in_one_line(saved, runs_root):
    source, damaged = damaged_copy(saved, runs_root, "shard-bytes-flipped", copy="explicit-source")
    run = launch(runs_root / "explicit", [*SAVING, f"checkpoint.resume={source / 'checkpoints' / 'step_4'}"], nproc=2)
    assert run.returncode != 0 and not run.metrics
    ours = [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("parallel3d:")]
    assert len(ours) == 1, ours
    assert "checkpoint.resume=" in ours[0] and damaged in ours[0] and "checksum mismatch" in ours[0]
    assert "Fix: name an earlier checkpoint" in ours[0]
    assert (run.run_dir / "logs" / "rank0.log").is_file()


def test_a_diverging_run_saves_no_non_finite_checkpoint(runs_root):
    """lr 30 without clipping: step 2 is finite, a later one is not, and no logging step comes before
    it; the bad-step guard stops the run at that step (every step is judged, not only logging
    steps), nothing non-finite is saved, and keep_last=1 did not rotate the good step_2 away. (A
    non-finite state the guard cannot see is refused by the save itself: the test below.)"""
    run = launch(runs_root / "diverging", [*FAST, "optim.lr=30", "train.grad_clip=0", "logging.log_every=5",
                                            "checkpoint.every=2", "checkpoint.keep_last=1"])
    assert run.returncode == 3
    ours = [line for line in run.stderr.splitlines() if line.startswith("parallel3d:")]
    assert len(ours) == 1 and "training diverged" in ours[0], ours
    stopped_at = int(re.search(r"at step (\d+)", ours[0]).group(1))
    assert 2 < stopped_at <= 4, ours  # before step 4's save
    root = run.run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_2"] and complete_steps(root) == [2]
    assert checkpoint_problem(root / "step_2") is None
    for shard in (root / "step_2").glob("*.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(str(shard)).values())


# -- the structure, at every verify level (unit checks on copies of the saved run) -------------


def _without_world_size(d: Path) -> None:  # a meta.json that cannot say how many ranks saved
    meta = json.loads((d / "meta.json").read_text())
    del meta["world_size"], meta["manifest"]
    (d / "meta.json").write_text(json.dumps(meta))


# case: (damage to a copy of step_4, verify levels, what the line says)
STRUCTURE = {
    "rank0 shard and manifest gone": ((lambda d: (_shard(d, 0).unlink(), (d / MANIFEST).unlink())),
                                      ("checksum", "size", "none"), "shard-00001-*.safetensors is missing: rank 0"),
    "rank1 shard gone, verify none": (lambda d: _shard(d, 1).unlink(), ("none",),
                                      "shard-00002-*.safetensors is missing: rank 1"),
    "rank0 shard gone, no world size": ((lambda d: (_shard(d, 0).unlink(), (d / MANIFEST).unlink(),
                                                    _without_world_size(d))),
                                        ("none",), "elements of layers.0.attention.wk.weight: a rank's shard-*"),
    "an rng file gone, verify none": (lambda d: (d / "rng" / "rank_1.safetensors").unlink(), ("none",),
                                      "rng/rank_1.safetensors is missing"),
    "manifest gone": (lambda d: (d / MANIFEST).unlink(), ("checksum", "size"),
                      "manifest.json is missing, but its meta.json says it was saved with one"),
    "config unparsable, verify none": (lambda d: (d / "config.yaml").write_text("model: [\n"), ("none",),
                                       "config.yaml is unreadable"),
    "config emptied": (lambda d: (d / "config.yaml").write_text(""), ("checksum", "size"), "config.yaml: size 0"),
    "config deleted": (lambda d: (d / "config.yaml").unlink(), ("checksum", "size"), "config.yaml is missing"),
    "config edited in place": (lambda d: (d / "config.yaml").write_text(re.sub(
        r"n_layers: \d", "n_layers: 7", (d / "config.yaml").read_text())), ("checksum",), "config.yaml: checksum mis"),
    "tiny manifest blocks": (lambda d: _edit_manifest(d, block_bytes=1), ("checksum", "size"),
                             "manifest.json is unreadable (block_bytes 1"),
    "manifest names a file outside": (lambda d: _edit_manifest(d, files={
        **json.loads((d / MANIFEST).read_text())["files"], "../../outside.bin": {"size": 1, "xxh3_64": ["0"]}}),
        ("checksum", "size"), "manifest.json is unreadable (entry '../../outside.bin' names a file outside"),
}


@pytest.mark.multirank  # the 2-rank run its copies come from
@pytest.mark.parametrize("case", list(STRUCTURE))
def test_a_checkpoint_is_used_only_when_whole_at_every_verify_level(saved, tmp_path, case):
    """Each damage falls back to step_2 at each level it names, with one line naming it."""
    damage, levels, said = STRUCTURE[case]
    root = tmp_path / "checkpoints"
    for step in (2, 4):
        shutil.copytree(saved.run_dir / "checkpoints" / f"step_{step}", root / f"step_{step}")
    damage(root / "step_4")
    for verify in levels:
        assert said in (checkpoint_problem(root / "step_4", verify) or ""), (verify, checkpoint_problem(root / "step_4",
                                                                                                         verify))
        assert checkpoint_problem(root / "step_2", verify) is None
        assert pick_checkpoint(root, "auto", announce=False, verify=verify) == root / "step_2"


# -- in one process ------------------------------------------------------------------------


def _state() -> TrainState:
    model = Transformer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                    max_seq_len=16))
    model.init_weights(0)
    return TrainState([model], torch.optim.AdamW(model.parameters()))


def test_a_save_commits_a_manifest_of_every_file(tmp_path):
    Checkpointer(tmp_path, CheckpointConfig()).save(1, _state(), {"samples_seen": 0}, "")
    step1 = tmp_path / "checkpoints" / "step_1"
    listed = set(read_manifest(step1)["files"])
    on_disk = {p.relative_to(step1).as_posix() for p in step1.rglob("*") if p.is_file()}
    assert listed == on_disk - {MANIFEST, COMPLETE}
    assert {"meta.json", "config.yaml", "rng/rank_0.safetensors"} <= listed
    assert checkpoint_problem(step1) is None


def test_a_checkpoint_without_a_manifest_loads_with_a_warning_only_if_saved_before_manifests(tmp_path, capsys):
    Checkpointer(tmp_path, CheckpointConfig()).save(1, _state(), {"samples_seen": 0}, "")
    step1 = tmp_path / "checkpoints" / "step_1"
    (step1 / MANIFEST).unlink()  # saved with one (meta.json says so), then lost: damaged at every level but none
    for verify in ("checksum", "size"):
        with pytest.raises(CheckpointError, match=rf"newest: {step1 / MANIFEST} is missing, but its meta.json says "
                                                  r"it was saved with one"):
            pick_checkpoint(tmp_path / "checkpoints", "auto", announce=False, verify=verify)
    meta = json.loads((step1 / "meta.json").read_text())
    del meta["manifest"]  # as a checkpoint saved before manifests existed
    (step1 / "meta.json").write_text(json.dumps(meta))
    assert pick_checkpoint(tmp_path / "checkpoints", "auto", announce=True) == step1
    assert "has no manifest.json (written before checkpoints had manifests)" in capsys.readouterr().err


def test_a_damaged_seed_checkpoint_is_refused_as_init_from(tmp_path):
    Checkpointer(tmp_path, CheckpointConfig()).save(0, TrainState(_state().parts), {"samples_seen": 0}, "")
    step0 = tmp_path / "checkpoints" / "step_0"
    assert "rng/rank_0.safetensors" in read_manifest(step0)["files"]  # seed checkpoints get manifests too
    verify_init_from(step0, "checksum", announce=False)
    shard = next(step0.glob("shard-*.safetensors"))
    _flip(shard, shard.stat().st_size - 1)
    verify_init_from(step0, "size", announce=False)  # same size: only the checksum sees it
    with pytest.raises(CheckpointError, match=rf"checkpoint.init_from={step0}: .*{shard.name}: checksum mismatch "
                                              r"in bytes .*Fix: write the seed checkpoint again"):
        verify_init_from(step0, "checksum", announce=False)


def test_shards_are_hashed_as_the_load_reads_them_and_a_flipped_byte_is_refused(tmp_path, monkeypatch, capsys):
    """Under checksum the pick checks the shards' sizes and the load hashes each block it reads,
    once; a flipped byte refuses the load before any tensor changes, and auto-resume falls back."""
    import parallel3d.checkpoint.manifest as manifest_module
    import parallel3d.checkpoint.reader as reader_module
    from parallel3d.checkpoint.resume import load_verified

    monkeypatch.setattr(manifest_module, "BLOCK", 4096)  # a shard of several blocks
    checkpointer, state = Checkpointer(tmp_path, CheckpointConfig()), TrainState(_state().parts)
    for step in (2, 4):
        checkpointer.save(step, state, {"samples_seen": 0}, "")
        with torch.no_grad():
            state.parts[0].norm.weight.add_(1.0)
    root, hashed, verified = tmp_path / "checkpoints", [], []
    hash_blocks, hash_of = manifest_module._hash_blocks, reader_module.hash_of
    monkeypatch.setattr(manifest_module, "_hash_blocks", lambda f, blocks, b: verified.extend(blocks) or
                        hash_blocks(f, blocks, b))
    monkeypatch.setattr(reader_module, "hash_of", lambda path, start, length: hashed.append((path.name, start)) or
                        hash_of(path, start, length))
    loaded = TrainState(_state().parts)
    assert load_verified(checkpointer=checkpointer, state=loaded, resume="auto", verify="checksum",
                         announce=False)[0] == root / "step_4"
    shard = next((root / "step_4").glob("shard-*.safetensors"))
    blocks = range(0, shard.stat().st_size, 4096)
    assert len(blocks) > 2 and [b for name, b in verified if name == shard.name] == [0]  # the header's block
    assert sorted(hashed) == [(shard.name, start) for start in blocks[1:]]  # the rest, once, as the load reads
    assert torch.equal(loaded.parts[0].norm.weight, state.parts[0].norm.weight - 1)
    _flip(shard, shard.stat().st_size - 3)
    fresh = TrainState(_state().parts)
    with torch.no_grad():  # values no checkpoint holds: a copied tensor would show
        for param in fresh.parts[0].parameters():
            param.fill_(7.0)
    before = {k: v.clone() for k, v in fresh.parts[0].state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"checkpoint.resume={root / 'step_4'}: {shard}: checksum mismatch in "
                                              rf"bytes {blocks[-1]}\.\..*Fix: name an earlier checkpoint"):
        load_verified(checkpointer=checkpointer, state=fresh, resume=str(root / "step_4"), verify="checksum",
                      announce=False)
    damaged = [k for k, (_, end) in reader_module._data_offsets(shard).items() if end > blocks[-1]]
    assert damaged and all(torch.equal(fresh.parts[0].state_dict()[k], before[k]) for k in damaged)  # never copied
    assert load_verified(checkpointer=checkpointer, state=fresh, resume="auto", verify="checksum",
                         announce=True)[0] == root / "step_2"
    said = [line for line in capsys.readouterr().err.splitlines() if "skipping corrupt checkpoint" in line]
    assert len(said) == 1 and f"{shard}: checksum mismatch" in said[0], said
    assert torch.equal(fresh.parts[0].norm.weight, state.parts[0].norm.weight - 2)


def test_a_non_finite_state_is_not_saved_and_the_good_checkpoint_stays(tmp_path):
    state = _state()
    checkpointer = Checkpointer(tmp_path, CheckpointConfig(keep_last=1))
    checkpointer.save(2, state, {"samples_seen": 0}, "")
    with torch.no_grad():
        state.parts[0].norm.weight[3] = float("nan")
    with pytest.raises(NonFiniteState, match=r"step 4: 1 tensor shards .* NaN or Inf, norm.weight among them: not "
                                             r"saved, step_2 stays the newest checkpoint. Fix: lower optim.lr"):
        checkpointer.save(4, state, {"samples_seen": 0}, "")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]


@pytest.mark.fast
def test_checkpoint_errors_are_one_line_naming_the_path_and_the_fix(tmp_path):
    from torch.distributed.checkpoint import CheckpointException

    full = OSError(28, "No space left on device")
    with pytest.raises(CheckpointError) as caught:
        with checkpoint_errors(tmp_path / "step_4", saving=True):
            raise CheckpointException("save failed", {1: (full, None)})
    assert str(caught.value) == (f"disk full writing {tmp_path / 'step_4'}: free space on its file system (or set "
                                 f"checkpoint.keep_last lower, or run_dir elsewhere) and run again; the previous "
                                 f"checkpoint is intact and the run resumes from it")
    assert caught.value.every_rank and caught.value.__cause__ is not None
    with pytest.raises(CheckpointError, match=rf"loading {tmp_path}/step_4 failed: Permission denied "
                                              rf"\({tmp_path}/x\). Fix: check the file system"):
        with checkpoint_errors(tmp_path / "step_4", saving=False):
            raise PermissionError(13, "Permission denied", str(tmp_path / "x"))


@pytest.mark.fast
def test_an_error_every_rank_raised_is_printed_once(tmp_path, capsys):
    shared, own = CheckpointError("disk full", every_rank=True), RunError("rank 1's own file")
    for rank in (0, 1):
        report_failure(shared, str(tmp_path), rank)
    report_failure(own, str(tmp_path), 1)
    printed = capsys.readouterr().err.splitlines()
    assert len(printed) == 2 and "disk full" in printed[0] and "rank 1: rank 1's own file" in printed[1]
    assert (tmp_path / "logs" / "rank1.log").read_text().count("CheckpointError: disk full") == 1


# -- a full disk --------------------------------------------------------------------------


def test_a_full_disk_anywhere_is_one_line_naming_the_path_and_nothing_after_it(tmp_path, capsys):
    """/dev/full answers every write with ENOSPC: the rank log it stands for, a token cache file,
    and a bare OSError each end in one line that names the path and the fix, with no traceback."""
    from parallel3d.data.dataset import write_array_file
    from parallel3d.runtime.failures import report_failure

    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.log").symlink_to("/dev/full")  # the run dir's disk is full too
    report_failure(OSError(28, "No space left on device", str(tmp_path / "metrics.jsonl")), str(tmp_path), 0)
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"parallel3d: error: disk full writing {tmp_path / 'metrics.jsonl'}: free space on its file "
                          f"system") and f"its traceback could not be written to {tmp_path / 'logs'}" in err, err
    cache = tmp_path / "cache" / "shard.bin"
    cache.parent.mkdir()
    (cache.parent / f".shard.bin.{os.getpid()}.tmp").symlink_to("/dev/full")
    with pytest.raises(RunError) as caught:
        write_array_file([np.arange(1 << 16)], np.uint16, cache, {})
    assert str(caught.value) == (f"disk full writing {cache}: free space on its file system, or set data.cache_dir "
                                 f"to a folder with room, and run again (finished files are kept)")
    assert sorted(p.name for p in cache.parent.iterdir()) == []  # nothing half-written left

# case: (ranks, overrides). A checkpoint of this model is ~11 MB at any rank count: the 16 MB disk
# takes step_2, and step_4 fills it.
# Two ranks only: they also show the ranks agreeing on the failure, and the saved run is their reference.
FULL_DISK = {
    "sync-2": (2, ["parallel.dp_shard=2"]),
    "async-2": (2, ["parallel.dp_shard=2", "checkpoint.async_save=true"]),
}
DISK = [*FAST, "train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=0"]


def _mount(folder: Path, size: str, remount: bool = False) -> subprocess.CompletedProcess:
    options = f"remount,size={size}" if remount else f"size={size}"
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def full_disks(runs_root, saved):
    """Each case trains on a 16 MB tmpfs until step_4's save fills it, then (the disk grown to 64 MB,
    space freed) resumes; the saved run, which had space to spare, is the reference."""
    roots = {name: runs_root / f"disk-{name}" for name in FULL_DISK}
    mounted = []
    try:
        for root in roots.values():
            root.mkdir()
            result = _mount(root, "16M")
            if result.returncode:
                pytest.skip(f"cannot mount a tmpfs to fill (needs root): {result.stderr.strip()}")
            mounted.append(root)
        failed = {name: launch(roots[name], [*DISK, *o], nproc=n) for name, (n, o) in FULL_DISK.items()}
        after = {name: (complete_steps(roots[name] / "checkpoints"), checkpoint_problem(
            roots[name] / "checkpoints/step_2")) for name in FULL_DISK}
        for root in roots.values():
            assert _mount(root, "64M", remount=True).returncode == 0
        resumed = launch_batch(runs_root, {f"disk-{name}": [*DISK, *o] for name, (_, o) in FULL_DISK.items()}, 2)
        yield {name: (failed[name], after[name], resumed.get(f"disk-{name}"), saved) for name in FULL_DISK}
    finally:
        for root in mounted:
            subprocess.run(["umount", str(root)], capture_output=True)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(FULL_DISK))
def test_a_full_disk_is_one_line_and_the_resume_after_it_is_exact(full_disks, name):
    failed, (steps, problem), resumed, reference = full_disks[name]
    assert failed.returncode != 0
    ours = [line for line in (failed.stdout + failed.stderr).splitlines() if line.startswith("parallel3d: error")]
    # nothing of ours after it: no rank's traceback, no Hydra's (torchrun's own summary of a failed job stays)
    assert len(ours) == 1 and not re.search(r'File ".*/parallel3d/', failed.stderr), failed.stderr[-3000:]
    assert "Error executing job" not in failed.stderr and "Logging error" not in failed.stderr
    assert "disk full writing" in ours[0] and "step_4" in ours[0] and "free space" in ours[0], ours
    assert (failed.run_dir / "logs" / "rank0.log").is_file()
    assert steps == [2] and problem is None  # step_2 intact, step_4's partial folder gone
    assert resumed is not None, "the resume after freeing space failed"
    resumed.assert_finished(4)
    assert "resumed from" in resumed.stdout and "step_2" in resumed.stdout
    assert resumed.losses == reference.losses
    step4, ref4 = resumed.run_dir / "checkpoints/step_4", reference.run_dir / "checkpoints/step_4"
    for shard in sorted(ref4.glob("shard-*.safetensors")):
        got, want = load_file(str(step4 / shard.name)), load_file(str(shard))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), shard.name
