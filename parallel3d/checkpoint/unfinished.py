"""Step folders without their ``COMPLETE`` marker, settled before a run resumes: nothing that could
still be used is deleted.

A save writes the ranks' files, then ``meta.json``, the manifest, and last the empty marker; a
kill stops it anywhere in that order. But a marker can also go missing on its own: it is an empty
file, which some copy and sync paths drop (minimum-size filters, object stores that skip empty
objects, cleanups of empty files). So a folder without one is:

- restored (its marker written again, with a line) when its manifest is there and the folder
  verifies against it: every file the save wrote is whole;
- removed (with a line) only when it provably never finished: no manifest, and either no
  meta.json (the save stopped before its commit) or a meta.json that says a manifest was to
  follow (it stopped between the two);
- otherwise set aside to ``run_dir/set-aside/`` (with a line): it is never loaded, never deleted.

A start that set a folder aside and is left with no checkpoint does not start afresh: it stops
in one line (``checkpoint.resume=none`` starts afresh on purpose).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from parallel3d.checkpoint.commit import COMPLETE, META, STEP_DIR, complete_steps, write_atomic
from parallel3d.checkpoint.errors import CheckpointError
from parallel3d.checkpoint.manifest import MANIFEST
from parallel3d.checkpoint.verify import checkpoint_problem

SET_ASIDE = "set-aside"


def settle_unfinished(*, root: Path, verify: str, resume: str, announce: bool) -> None:
    """Restore, remove or set aside each step folder of ``root`` (run_dir/checkpoints) that lacks
    its marker, saying each on the console when ``announce``. Collective when a process group is
    up: the ranks share the verification, rank 0 moves the files, every rank decides alike.
    Raises CheckpointError when folders were set aside and no complete checkpoint is left to resume."""
    group = dist.group.WORLD if dist.is_initialized() else None
    first = dist.get_rank() == 0 if group is not None else True
    unfinished = sorted((p for p in root.iterdir() if STEP_DIR.match(p.name) and not (p / COMPLETE).is_file()),
                        key=lambda p: int(STEP_DIR.match(p.name).group(1))) if root.is_dir() else []
    if group is not None:
        dist.barrier(group=group)  # every rank listed the folders before rank 0 changes any
    set_aside, removed = [], False
    for path in unfinished:
        verdict, line = _verdict(path, verify, group)
        if first:
            if verdict == "restore":
                write_atomic(path / COMPLETE, "")
            elif verdict == "remove":
                shutil.rmtree(path, ignore_errors=True)
            else:
                line = f"{line}: set aside to {_set_aside(path)}"
        if verdict == "set aside":
            set_aside.append(line)
        removed |= verdict == "remove"
        if announce:
            print(f"parallel3d: {line}", file=sys.stderr if verdict == "set aside" else sys.stdout, flush=True)
    if group is not None:
        dist.barrier(group=group)
    if resume == "auto" and not complete_steps(root) and removed and not set_aside and announce:
        print(f"parallel3d: no checkpoint in {root} had finished: starting from step 1", flush=True)
    if set_aside and resume == "auto" and not complete_steps(root):
        raise CheckpointError(f"no complete checkpoint is left in {root} ({len(set_aside)} set aside: "
                              f"{set_aside[0]}). Fix: check that folder (checkpoint.resume=PATH loads a checkpoint "
                              f"you trust, with its COMPLETE file), or checkpoint.resume=none to start afresh (the "
                              f"old run is moved aside)", every_rank=True)


def _verdict(path: Path, verify: str, group) -> tuple[str, str]:
    """("restore" | "remove" | "set aside", the line that says so) for one folder without a marker."""
    if not (path / MANIFEST).is_file():
        if not (path / META).is_file() or _meta(path).get("manifest") == MANIFEST:
            return "remove", f"removed incomplete checkpoint {path} (a save that did not finish)"
        return "set aside", f"{path} has no {COMPLETE} marker and no {MANIFEST} to verify it against"
    # At least the sizes: a marker is restored only on evidence that every file is whole.
    problem = checkpoint_problem(path, verify if verify != "none" else "size", group=group)
    if problem is None:
        return "restore", (f"restored the {COMPLETE} marker of {path}: the save had finished and its files "
                           f"verify against its manifest (the empty marker file was lost)")
    return "set aside", f"{path} has no {COMPLETE} marker and does not verify ({problem})"


def _meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META).read_text())
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return {}


def _set_aside(path: Path) -> Path:
    """Move ``path`` to run_dir/set-aside/ (a new name when one is there); returns where."""
    folder = path.parent.parent / SET_ASIDE
    folder.mkdir(exist_ok=True)
    dest, n = folder / path.name, 1
    while dest.exists():
        dest, n = folder / f"{path.name}.{n}", n + 1
    path.rename(dest)
    return dest
