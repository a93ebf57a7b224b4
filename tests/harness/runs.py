"""Training runs in subprocesses, judged by what they wrote.

Runs go through ``python -m parallel3d.train`` (one process) or ``torchrun`` (several gloo ranks
on CPU) in subprocesses with timeouts, several layouts per launch where they can
(``layout_batch.py``). A run is judged by its metrics.jsonl, not only torchrun's exit code: gloo
occasionally aborts a worker at exit after the run has finished (see NOTES).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.tolerance import Tolerance, measure, twins

RUN_TIMEOUT_S = 300
BATCH_TIMEOUT_S = 120
BATCH_SIZE = 8  # layouts per launch: bounds what one failure sends back to launches of their own
# Every test run: a short, fast variant of the default recipe.
# optim.eps=1e-6: AdamW's update m/sqrt(v) ignores the gradient's scale, so with eps=1e-8 an element
# whose gradient is pure round-off (~1e-10) still moves by up to lr per step, in a direction the
# round-off picks: after 10 steps one element of layers.1.attention.wv differed by 2.9e-5 between
# tied layouts whose losses agreed to 2e-7. eps=1e-6 damps such elements, so the final weights'
# sensitivity to round-off, and with it their derived tolerance (tolerance.py), stays small.
# train.micro_batch_size=4: a step's cost is mostly its micro batches (forward and backward each pay
# the per-call overhead of DTensor and the collectives); 4 sequences keep 2 to 4 micro batches per
# step where the ranks hold 8 to 16 sequences (dp 1 or 2), so every such layout still accumulates,
# and dp4 layouts that are about accumulation set 2 themselves.
STEPS = 10  # the FAST run's steps: a test that means "the last step" says STEPS
FAST = [f"train.steps={STEPS}", "optim.warmup_steps=2", "train.seq_len=64", "train.global_batch_size=16",
        "train.micro_batch_size=4", "optim.eps=1e-6"]


@dataclass
class Run:
    run_dir: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.metrics]

    @classmethod
    def from_record(cls, record: dict) -> Run:
        """A run of tests/harness/store.py's records."""
        return cls(Path(record["run_dir"]), record["returncode"], record["stdout"], record["stderr"])

    def record(self) -> dict:
        return {"run_dir": str(self.run_dir), "returncode": self.returncode, "stdout": self.stdout,
                "stderr": self.stderr}

    def assert_finished(self, steps: int) -> None:
        got = [row["step"] for row in self.metrics]
        assert got and got[-1] == steps, f"run stopped at {got[-1:]}, rc={self.returncode}\n{self.stderr[-3000:]}"


def env() -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    e.pop("RANK", None), e.pop("WORLD_SIZE", None), e.pop("LOCAL_RANK", None)
    return e


def launch(run_dir: Path, overrides: list[str], nproc: int = 1, launcher: str = "auto",
           timeout: int = RUN_TIMEOUT_S) -> Run:
    """Train with these overrides on ``nproc`` CPU ranks; wait for it (with a timeout)."""
    args = [f"run_dir={run_dir}", *overrides]
    if launcher == "auto":
        launcher = "python" if nproc == 1 else "torchrun"
    if launcher == "python":
        cmd = [sys.executable, "-m", "parallel3d.train", *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "parallel3d.train", *args]
    else:  # our launcher
        cmd = [sys.executable, "-m", "parallel3d.launch.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=run_dir.parent)
    return Run(run_dir, proc.returncode, proc.stdout, proc.stderr)


def refused_by_the_launcher(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """parallel3d-run in this process with a config it must refuse: (exit code, stderr). Starting
    torchrun instead (its os.execv, or a sweep's subprocess) fails the test."""
    from parallel3d.launch import run

    def started(*args, **kwargs):
        pytest.fail(f"the launcher started torchrun: {args}")

    monkeypatch.setattr(run.os, "execv", started)
    monkeypatch.setattr(run.subprocess, "run", started)
    with pytest.raises(SystemExit) as exited:
        run.main(argv)
    return exited.value.code, capsys.readouterr().err


def launch_batch(root: Path, layouts: dict[str, list[str]], nproc: int) -> dict[str, Run]:
    """Train ``layouts`` (name: overrides) one after another in one launch of tests/harness/layout_batch.py,
    each into ``root/name``; returns the runs that succeeded on every rank. A failed layout ends the
    batch, so the caller launches it and any left over on their own (with that launch's errors)."""
    spec = root / f"batch-{'-'.join(layouts)[:80]}-{os.getpid()}.json"
    spec.write_text(json.dumps([{"run_dir": str(root / name), "overrides": o} for name, o in layouts.items()]))
    script = str(Path(__file__).with_name("layout_batch.py"))
    cmd = ([sys.executable, script] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script])
    try:
        subprocess.run([*cmd, str(spec)], capture_output=True, text=True, env=env(), cwd=root,
                       timeout=BATCH_TIMEOUT_S + RUN_TIMEOUT_S * len(layouts) // 3)
    except subprocess.TimeoutExpired:
        pass  # what finished before is kept; the rest run on their own
    runs = {}
    for name in layouts:
        results = [json.loads(p.read_text()) for p in sorted((root / f"{name}.batch").glob("rank*.json"))]
        log_layout_cpu(name, nproc, [r.get("cpu_s", 0.0) for r in results])
        if len(results) == nproc and all(r["returncode"] == 0 for r in results):
            runs[name] = Run(root / name, 0, results[0]["stdout"], results[0]["stderr"])
    return runs


def log_layout_cpu(name: str, nproc: int, cpu_s: list[float]) -> None:
    """``P3D_TEST_CPU_LOG=FILE``: also a line per layout trained in a batch, its ranks' CPU seconds
    summed (the launch's start-up apart), so that the cost of each layout of a matrix shows."""
    log = os.environ.get("P3D_TEST_CPU_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"layout": name, "nproc": nproc, "cpu_s": round(sum(cpu_s), 2)}) + "\n")


def launch_measured(root: Path, overrides: list[str], steps: int, name: str = "single",
                    **measure_args) -> tuple[Run, Tolerance]:
    """One process trains ``overrides`` into ``root/name`` and its twin (perturbed gradients,
    tests/harness/tolerance.py) beside it, in one launch; returns the run and the Tolerance the
    spread between the two implies (``measure_args``: tolerance.measure's)."""
    runs = {name: overrides, **twins(name, overrides)}
    done = launch_batch(root, runs, nproc=1)
    for run_name, run_overrides in runs.items():
        if run_name not in done:  # failed in the batch: again on its own, with its own errors
            done[run_name] = launch(root / run_name, run_overrides)
        done[run_name].assert_finished(steps)
    return done[name], measure(done[name], *(done[twin] for twin in twins(name, overrides)), **measure_args)


def final_weights(run_dir: Path) -> dict:
    """What ``train.save_model=true`` wrote: the Hugging Face folder run_dir/hf/ (Hugging Face names)
    and a LoRA run's adapters (run_dir/hf_adapter/), or, for a model no Hugging Face family has,
    run_dir/model.safetensors (our names)."""
    from safetensors.torch import load_file

    files = sorted((run_dir / "hf").glob("*.safetensors")) or [run_dir / "model.safetensors"]
    files += sorted((run_dir / "hf_adapter").glob("*.safetensors"))
    return {key: tensor for path in files for key, tensor in load_file(str(path)).items()}


def relative_error(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def batch_records(root: Path, layouts: dict[str, list[str]], nproc: int) -> dict[str, dict]:
    return {name: run.record() for name, run in launch_batch(root, layouts, nproc).items()}


def one_record(run_dir: Path, overrides: list[str], nproc: int) -> dict:
    return launch(run_dir, overrides, nproc=nproc).record()


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
