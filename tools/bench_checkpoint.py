#!/usr/bin/env python
"""Checkpoint save and load time, with and without the manifest and its verification.

    python tools/bench_checkpoint.py [--dim 1024] [--layers 4] [--repeats 3] [--folder DIR]

One process saves a model and its AdamW state (fp32: 12 bytes a parameter; the defaults make
~1.4 GB) with ``Checkpointer.save``, with the manifest (the default) and with ``write_manifest``
replaced by a no-op, alternating. Then ``pick_checkpoint`` + ``Checkpointer.load`` under each
``checkpoint.verify`` mode, as ``resume.load_verified`` runs them (under ``checksum`` the pick
checks sizes and hashes the small files and each shard's first block; the load hashes the other
shard blocks as it reads them), twice: with the files in the page cache (written just before: the
verification costs its hashing alone, the worst case for its share), and with the checkpoint's
own files evicted from the cache first (fsync + POSIX_FADV_DONTNEED; nothing else of the
machine's cache is touched). Medians over repeats. Prints a Markdown block for BENCHMARKS.md
(date, machine, command, load average).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_common import heading

from parallel3d.checkpoint import checkpointer as checkpoint_module
from parallel3d.checkpoint import commit as commit_module
from parallel3d.checkpoint.checkpointer import Checkpointer
from parallel3d.checkpoint.resume import pick_checkpoint
from parallel3d.checkpoint.state import TrainState
from parallel3d.config.schema import CheckpointConfig, ModelConfig, OptimConfig
from parallel3d.models import Transformer
from parallel3d.optim.adamw import build_optimizer, init_optimizer_state


def build_state(dim: int, layers: int) -> TrainState:
    model = Transformer(ModelConfig(dim=dim, n_layers=layers, n_heads=dim // 128, n_kv_heads=dim // 128,
                                    ffn_dim=int(dim * 2.75), vocab_size=32000, max_seq_len=128))
    model.init_weights(0)
    optimizer = build_optimizer(model, OptimConfig())
    init_optimizer_state(optimizer)
    return TrainState([model], optimizer)


def timed(fn, cpu: list | None = None) -> float:
    """Wall seconds of ``fn()``; its process CPU seconds (every thread) appended to ``cpu``."""
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    if cpu is not None:
        cpu.append(time.process_time() - start_cpu)
    return time.perf_counter() - start


def evict(folder: Path) -> None:
    """Drop these files (and only these) from the page cache: the next read comes from the disk."""
    for path in (p for p in folder.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(state: TrainState, folder: Path, repeats: int) -> dict:
    times: dict = {}
    checkpointer = Checkpointer(folder, CheckpointConfig(keep_last=1))
    real = commit_module.write_manifest, commit_module.verify_manifest, checkpoint_module.file_entries
    for repeat in range(repeats):
        for manifest in ((True, False) if repeat % 2 == 0 else (False, True)):
            if not manifest:  # nothing hashed, no manifest written, none checked before keep_last removes the older one
                commit_module.write_manifest = commit_module.verify_manifest = lambda *a, **k: None
                checkpoint_module.file_entries = lambda *a, **k: {}
            try:
                seconds = timed(lambda: checkpointer.save(repeat, state, {"samples_seen": 0}, ""))
            finally:
                (commit_module.write_manifest, commit_module.verify_manifest,
                 checkpoint_module.file_entries) = real
            times.setdefault(("save", manifest), []).append(seconds)
    checkpointer.save(repeats, state, {"samples_seen": 0}, "")  # with its manifest: the one loaded
    target = build_state(state.parts[0].tok_embeddings.weight.shape[1], len(state.parts[0].layers))
    for _ in range(repeats):
        for cache in ("warm", "cold"):
            for mode in ("none", "size", "checksum"):
                if cache == "cold":
                    evict(checkpointer.root)
                picked, cpu = [], []  # as resume.load_verified does it: the shards' blocks hashed by the load
                verify = timed(lambda: picked.append(pick_checkpoint(checkpointer.root, "auto", announce=False,
                                                                     verify=mode, hashed_at_load=True)), cpu)
                assert picked[0] == checkpointer.root / f"step_{repeats}"
                load = timed(lambda: checkpointer.load(picked[0], target, hash_shards=mode == "checksum"), cpu)
                times.setdefault((cache, mode, "verify"), []).append(verify)
                times.setdefault((cache, mode, "load"), []).append(load)
                times.setdefault((cache, mode, "cpu"), []).append(sum(cpu))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    state = build_state(args.dim, args.layers)
    folder = Path(tempfile.mkdtemp(prefix="bench-checkpoint-", dir=args.folder))
    try:
        times = measure(state, folder, args.repeats)
        size = sum(p.stat().st_size for p in (folder / "checkpoints").rglob("*") if p.is_file()) / 2 ** 30
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(heading("Checkpoint save and load, one process", "bench_checkpoint.py", argv,
                  f"checkpoint {size:.2f} GiB, load average {os.getloadavg()[0]:.1f} at the end") + "\n")
    with_manifest, without = median[("save", True)], median[("save", False)]
    print(f"Save: {with_manifest:.2f} s with the manifest, {without:.2f} s without "
          f"({with_manifest / without - 1:+.1%}).\n")
    print("| page cache | checkpoint.verify | verify s | load s | verify + load against load alone | CPU s "
          "(all threads) | CPU against load alone |\n|---|---|---|---|---|---|---|")
    for cache in ("warm", "cold"):
        alone = median[(cache, "none", "verify")] + median[(cache, "none", "load")]
        for mode in ("none", "size", "checksum"):
            verify, load, cpu = (median[(cache, mode, what)] for what in ("verify", "load", "cpu"))
            print(f"| {cache} | {mode} | {verify:.3f} | {load:.3f} | {(verify + load) / alone - 1:+.1%} | {cpu:.3f} | "
                  f"{cpu / median[(cache, 'none', 'cpu')] - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
