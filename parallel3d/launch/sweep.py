"""Hydra sweeps for launchers: ``--multirun a=1,2 b=x,y`` as one override list per job.

Hydra's own ``--multirun`` runs every job inside the one Python process that parsed it. A
multi-rank job needs a fresh torchrun (or a fresh SLURM allocation) per combination instead, so
the launchers expand the sweep here, with Hydra's own override parser: every sweep syntax Hydra
accepts (``a=1,2``, ``range(...)``, ``choice(...)``, ``glob(...)``) means the same, and the jobs
come in the order Hydra's basic sweeper would run them. Each job gets its own run_dir,
``hydra.sweep.dir/<job number>``, as under Hydra.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from parallel3d.runtime.rundir import MULTIRUN_FLAGS, given_run_dir, hydra_settings, key_of, run_dir_override

__all__ = ["MULTIRUN_FLAGS", "Job", "expand", "key_of", "plan", "record", "sweep_dir"]


@dataclass
class Job:
    overrides: list[str]  # complete: the sweep's values and the pinned run dir
    run_dir: Path
    label: str  # what varies, e.g. "optim.lr=0.001 parallel.tp=2"


def expand(overrides: list[str]) -> list[tuple[list[str], list[str]]]:
    """Per job: its override list and the part of it that the sweep varies (Hydra's order)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([(f"{key}={value}", True) for value in override.sweep_string_iterator()])
        else:
            choices.append([(override.input_line, False)])
    return [([o for o, _ in job], [o for o, varies in job if varies]) for job in itertools.product(*choices)]


def plan(overrides: list[str]) -> list[Job]:
    """Every job of the sweep with its own run_dir: ``<root>/<n>``.

    The root is ``run_dir`` when the sweep sets one, else ``hydra.sweep.dir`` resolved once, now
    (its default holds a timestamp).
    """
    given = given_run_dir(overrides)
    overrides = [o for o in overrides if key_of(o) not in ("run_dir", "hydra.run.dir")]
    jobs = expand(overrides)
    root = Path(os.path.abspath(given if given is not None else sweep_dir(jobs[0][0])))
    return [Job([*job, run_dir_override(root / str(n))], root / str(n), " ".join(varies))
            for n, (job, varies) in enumerate(jobs)]


def record(jobs: list[Job]) -> Path:
    """``<root>/sweep.json``: which folder holds which combination."""
    root = jobs[0].run_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"job": n, "run_dir": str(job.run_dir), "swept": job.label} for n, job in enumerate(jobs)]
    (root / "sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    return root


def sweep_dir(overrides: list[str]) -> str:
    """``hydra.sweep.dir`` as Hydra would resolve it for a sweep started now."""
    return str(hydra_settings(overrides).sweep.dir)
