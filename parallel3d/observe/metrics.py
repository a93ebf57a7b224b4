"""What a run reports: metrics.jsonl (the source of truth), the console on rank 0, wandb and
TensorBoard.

MFU = achieved model FLOPs / peak FLOPs of the devices. Peaks are dense (no sparsity) and come
from the vendors' datasheets; a device missing from the table, and every CPU, reports ``null``
rather than a made-up figure.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn

from parallel3d.base import local_tensor
from parallel3d.progress import Progress

INIT_TIMEOUT_S = 60.0  # wandb.init's wait for its server before the run goes on offline

# Dense peak FLOP/s per device by compute dtype (float32 trains on TF32 tensor cores).
PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494.7e12},
    "H100 PCIe": {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494.7e12},
    "B200": {"bfloat16": 2250e12, "float16": 2250e12, "float32": 1100e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "L40S": {"bfloat16": 362e12, "float16": 362e12, "float32": 183e12},
    "A10G": {"bfloat16": 70e12, "float16": 70e12, "float32": 35e12},
    "MI300X": {"bfloat16": 1307e12, "float16": 1307e12, "float32": 653.7e12},
}


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (always None on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_FLOPS.items():  # ordered so "H100 PCIe" matches before "H100"
        if key in name:
            return peaks.get(dtype)
    return None


def max_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: allocator peak on a GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _local_bytes(t: torch.Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards only)."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "param_bytes": sum(_local_bytes(p) for p in params),
        "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optim_state_bytes": sum(_local_bytes(v) for v in state),
    }


class MetricsLogger:
    """Writes one JSON object per logged step; rank 0 only (other ranks get a no-op logger)."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, wandb_run=None, resumed_at: int = 0,
                 progress: Progress | None = None, tensorboard=None):
        self.enabled, self.total_steps, self.wandb_run, self.tensorboard = enabled, total_steps, wandb_run, tensorboard
        # Console lines go through the progress display: above its bar on a terminal, plain otherwise.
        self.progress = progress if progress is not None else Progress(enabled=enabled)
        self.path = run_dir / "metrics.jsonl"
        self.start, self.first_step = time.perf_counter(), resumed_at
        self._file = None
        if enabled:  # a fresh run starts its own record; a resumed one keeps the rows up to its checkpoint
            self._keep_until(resumed_at)

    def _keep_until(self, step: int) -> None:
        kept = kept_rows(self.path, step) if step and self.path.exists() else []
        tmp = self.path.with_name(self.path.name + ".tmp")  # a kill now must not lose the kept rows
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a")

    def rewind(self, step: int) -> None:
        """Drop the rows after ``step``: training rolled back to its checkpoint, as a resume would."""
        if self.enabled:
            self._file.close()
            self._keep_until(step)
            self.start, self.first_step = time.perf_counter(), step
            if self.tensorboard is not None:  # the abandoned steps' points go, as their rows did
                self.tensorboard.close()
                self.tensorboard = start_tensorboard(Path(self.tensorboard.log_dir).parent, step)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if v is not None}, step=row["step"])
        step = row["step"]
        if self.tensorboard is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(key, value, global_step=step)
            self.tensorboard.flush()  # the file is the record: a kill must not lose the logged steps
        elapsed = time.perf_counter() - self.start
        eta = elapsed / (step - self.first_step) * (self.total_steps - step)
        mfu = f" | mfu {row['mfu'] * 100:.1f}%" if row.get("mfu") is not None else ""
        mfu += f" | val_loss {row['val_loss']:.4f}" if "val_loss" in row else ""
        self.progress.write(
            f"[{step:>{len(str(self.total_steps))}}/{self.total_steps}] loss {row['loss']:.4f} | "
            f"grad_norm {row['grad_norm']:.3f} | lr {row['lr']:.2e} | {row['tokens_per_sec']:,.0f} tok/s{mfu} | "
            f"mem {row['max_memory_bytes'] / 2**30:.2f} GiB | eta {_duration(eta)}", loss=row["loss"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


def parsed_lines(path: Path) -> list[tuple[int, str, dict | None]]:
    """Each non-empty line of a metrics.jsonl as (line number, text, its row), the row None where
    the line is not a JSON object with a ``step`` (a write cut short by a kill)."""
    parsed = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            parsed.append((n, line, row if isinstance(row, dict) and "step" in row else None))
        except ValueError:
            parsed.append((n, line, None))
    return parsed


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl's rows sorted by step; a step logged twice (after a resume or a rollback) keeps
    its last row. A partial last line (a run still writing, or killed mid-write) is left out; an
    unreadable line before it raises ValueError naming the file and line."""
    lines = parsed_lines(path)
    by_step = {}
    for i, (n, _, row) in enumerate(lines):
        if row is None:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{n}: not a JSON object with a step")
        by_step[row["step"]] = row
    return [by_step[step] for step in sorted(by_step)]


def kept_rows(path: Path, resumed_at: int) -> list[str]:
    """The lines of metrics.jsonl up to step ``resumed_at``. A line that does not parse (the half
    written last line of a killed run) is dropped with a message: it must not block the resume."""
    kept = []
    for n, line, row in parsed_lines(path):
        if row is None:
            print(f"parallel3d: dropped unreadable line {n} of {path} (a write cut short)", file=sys.stderr,
                  flush=True)
        elif row["step"] <= resumed_at:
            kept.append(line)
    return kept


def start_wandb(wandb_cfg, run_dir: Path, config: dict, resumed: bool = False):
    """A wandb run on rank 0, offline unless an API key (or an explicit mode) says otherwise.

    Its id is kept in ``run_dir/wandb/run_id``: a run resumed from one of its checkpoints (a
    restart, a requeued Slurm job) continues the same wandb run; a fresh start gets a new one.
    Online, a server that cannot be reached, or a ``wandb.init`` that fails or does not answer
    within ``WANDB_INIT_TIMEOUT`` seconds (default INIT_TIMEOUT_S), falls back to offline with one
    line: wandb never stops a run. Offline runs are uploaded later with
    ``wandb sync run_dir/wandb/offline-run-*``.
    """
    import wandb  # imported only when enabled: it is slow to import and absent on some machines

    mode = wandb_mode(wandb_cfg.mode)
    sync = f"upload later with `wandb sync {run_dir / 'wandb'}/offline-run-*`"
    if mode == "online" and not server_reachable(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")):
        print(f"parallel3d: warning: wandb server unreachable: logging offline ({sync})", file=sys.stderr, flush=True)
        mode = "offline"
    if mode == "offline":  # wandb 0.31's error reporting calls its server even offline (measured)
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    id_file = run_dir / "wandb" / "run_id"
    id_file.parent.mkdir(parents=True, exist_ok=True)
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
    # Online, "allow" continues the run's history after its last logged step; offline it keeps
    # the id, and `wandb sync --append` adds the new part to the run.
    options = dict(project=wandb_cfg.project, entity=wandb_cfg.entity, name=wandb_cfg.name, group=wandb_cfg.group,
                   tags=list(wandb_cfg.tags), dir=str(run_dir), config=config, id=run_id,
                   resume="allow" if run_id else None)
    timeout_s = float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S))
    try:
        run = wandb.init(mode=mode, settings=wandb.Settings(init_timeout=timeout_s), **options)
    except Exception as e:  # CommError on a server that accepts but never answers, an auth error, ...
        if mode != "online":
            raise
        reason = " ".join(str(e).split())[:160] or type(e).__name__
        print(f"parallel3d: warning: wandb.init failed or did not answer within {timeout_s:g} s ({reason}): "
              f"logging offline ({sync})", file=sys.stderr, flush=True)
        os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        run = wandb.init(mode="offline", **options)
    id_file.write_text(run.id + "\n")
    return run


def start_tensorboard(run_dir: Path, resumed_at: int = 0):
    """A TensorBoard writer on rank 0 under ``run_dir/tensorboard``. Every scalar is written at its
    step, so a resumed run continues the same curves; what a killed run logged after the checkpoint
    it resumes from is purged (``purge_step``), as metrics.jsonl drops those rows."""
    from torch.utils.tensorboard import SummaryWriter  # imported only when enabled: tensorboard is optional

    return SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resumed_at + 1 if resumed_at else None)


def wandb_mode(configured: str | None) -> str:
    """offline or disabled, said by WANDB_MODE or logging.wandb.mode, always wins (an API key in the
    environment does not turn it online); then an explicit mode; then online only with an API key."""
    explicit = [m for m in (os.environ.get("WANDB_MODE"), configured) if m]
    for quiet in ("disabled", "offline", "dryrun"):
        if quiet in explicit:
            return "offline" if quiet == "dryrun" else quiet
    if explicit:
        return explicit[0]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def server_reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to ``url``'s host opens within ``timeout_s`` (no request is sent):
    wandb itself would wait about 105 s before failing the run."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
