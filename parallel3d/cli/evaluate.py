#!/usr/bin/env python
"""val_loss of a finished checkpoint, on any held-out data, at any layout.

    parallel3d-evaluate CHECKPOINT [key=value ...]                          # one process
    torchrun --nproc-per-node N -m parallel3d.cli.evaluate CHECKPOINT [key=value ...]

CHECKPOINT: a step_<N> folder, or a run_dir or its checkpoints/ folder (the newest complete
checkpoint that verifies). The config is the checkpoint's own config.yaml with its layout
(``parallel.*``) reset to the defaults, then the overrides: ``eval.sources=[held_out.jsonl]`` (or
``eval.fraction`` of the run's data.sources), ``eval.batches``, ``parallel.tp=2``... Training's own
evaluation runs (parallel3d/inference/evaluate.py ``open_evaluator``): the held-out data read as the
run read it (instruction records rendered with its data.format, chat template, train_on, packing and
train.seq_len, scored on their trained tokens only), the same batches, the same val_loss at every layout.

The result is printed and appended as one JSON line to ``run_dir/metrics.jsonl``, where run_dir
defaults to ``<the training run_dir>/eval/step_<N>`` (set ``run_dir=`` to choose): never the
training run's own metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from parallel3d.base import ConfigError, rank, world_size_from_env
from parallel3d.checkpoint.checkpointer import Checkpointer
from parallel3d.checkpoint.state import TrainState
from parallel3d.config.schema import Config, ParallelConfig
from parallel3d.data import Workers
from parallel3d.inference.evaluate import open_evaluator
from parallel3d.inference.generate import resolve_checkpoint
from parallel3d.progress import Progress
from parallel3d.runtime.failures import report_failure
from parallel3d.runtime.process_group import init_distributed
from parallel3d.step import build_setup
from parallel3d.validate import check

USAGE = "usage: parallel3d-evaluate CHECKPOINT [key=value ...] (see docs/finetune.md)"


def default_run_dir(step_dir: Path) -> Path:
    """``<training run_dir>/eval/step_<N>``: next to the run, apart from its metrics."""
    run_dir = step_dir.parent.parent if step_dir.parent.name == "checkpoints" else step_dir.parent
    return run_dir / "eval" / step_dir.name


def evaluation_config(step_dir: Path, overrides: list[str]):
    """The checkpoint's config at the default layout, no checkpointing, then ``overrides``."""
    saved = OmegaConf.load(step_dir / "config.yaml")
    saved.parallel = OmegaConf.structured(ParallelConfig)  # the saved layout is the training run's, not ours
    saved.checkpoint.merge_with({"resume": "none", "init_from": None, "create_seed": False, "every": 0})
    saved.run_dir = str(default_run_dir(step_dir))
    try:
        given = OmegaConf.from_dotlist(overrides)
        return OmegaConf.merge(OmegaConf.structured(Config), saved, given)
    except Exception as e:  # an unknown key or a wrong type, as OmegaConf words it
        raise ConfigError(" ".join(overrides), "", f"not a valid override ({e})".replace("\n", " "),
                          "give key=value pairs of the config (docs/configuration.md)") from e


def evaluate_checkpoint(step_dir: Path, overrides: list[str]) -> dict:
    """Evaluate on every rank of this launch; returns the metrics line (the same on every rank)."""
    world_size = world_size_from_env()
    cfg = check(evaluation_config(step_dir, overrides), world_size)
    c: Config = OmegaConf.to_object(cfg)
    if not c.eval.sources and not (c.eval.fraction > 0 and c.data.sources):
        raise ConfigError("eval.sources", "[]", "nothing to evaluate on (and no eval.fraction of data.sources)",
                          "set eval.sources=[FILES] or eval.fraction with the run's data.sources")
    device = init_distributed(c.train, world_size)
    setup = build_setup(c, device)
    meta = Checkpointer(Path(c.run_dir), c.checkpoint).load(step_dir, TrainState(setup.parts))
    workers = Workers(rank(), world_size, dist.barrier if dist.is_initialized() else None)
    evaluator = open_evaluator(c, setup.spec, workers, Progress(enabled=rank() == 0))
    if rank() == 0:
        print(f"parallel3d-evaluate: {step_dir}: {c.eval.batches} batches of {c.train.global_batch_size} x "
              f"{c.train.seq_len} tokens at {setup.dims.sizes()}", flush=True)
    start = time.perf_counter()
    result = evaluator.evaluate(setup, done=f"evaluated {step_dir.name}")
    return {"step": meta["step"], **result, "checkpoint": str(step_dir), "eval_sources": list(c.eval.sources),
            "eval_fraction": c.eval.fraction, "eval_batches": c.eval.batches, "layout": setup.dims.sizes(),
            "eval_time_s": round(time.perf_counter() - start, 3)}


def write_line(run_dir: Path, line: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__}")
        return 0
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print(USAGE, file=sys.stderr)
        return 2
    run_dir = None
    try:
        step_dir = resolve_checkpoint(Path(argv[0]), announce=rank() == 0)
        run_dir = Path(str(evaluation_config(step_dir, argv[1:]).run_dir))
        line = evaluate_checkpoint(step_dir, argv[1:])
        if rank() == 0:
            path = write_line(run_dir, line)
            print(f"parallel3d-evaluate: {step_dir}: val_loss {line['val_loss']:.6f} "
                  f"(perplexity {line['val_perplexity']:.4f}) -> {path}", flush=True)
        return 0
    except ConfigError as e:
        if rank() == 0:
            print(f"parallel3d-evaluate: config error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        report_failure(e, None if run_dir is None else str(run_dir), rank())
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def console_main() -> None:
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # gloo can abort a finished multi-rank process in C++ static destructors (parallel3d/train.py's main)
    os._exit(code) if world_size_from_env() > 1 else sys.exit(code)


if __name__ == "__main__":
    console_main()
