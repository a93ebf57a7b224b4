"""The process group: one per run, over gloo (CPU) or NCCL (CUDA), with a timeout, and what
names a hang when that timeout strikes: the watchdog (parallel3d/runtime/watchdog.py) and, on CUDA,
NCCL's flight recorder."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.base import rank, resolve_device
from parallel3d.runtime import watchdog
from parallel3d.runtime.failures import ensure_rank_log

FLIGHT_RECORDER_ENTRIES = 20000  # the last collectives NCCL records per rank, dumped on a timeout


def attempt_store(timeout):
    """The process group's store for this attempt of a ``torchrun --max-restarts`` job, or None.

    Since torch 2.5 torchrun's agent shares one TCPStore with every attempt's workers
    (TORCHELASTIC_USE_AGENT_STORE=True), and env:// puts each attempt's process-group keys under
    the same names: a restarted group reads its dead predecessor's addresses and fails
    ("Connection refused", pytorch#135712). A prefix per attempt (TORCHELASTIC_RESTART_COUNT, the
    same on every node: all agents restart together) gives each attempt keys of its own, so plain
    torchrun restarts need no TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"parallel3d/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def init_distributed(train, world_size: int) -> torch.device:
    if resolve_device(train.device) == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():  # a caller's own group (tests/harness/layout_batch.py) is kept
        timeout = timedelta(seconds=train.dist_timeout_s)
        store = attempt_store(timeout)  # None: torch's env:// rendezvous, as before
        if device.type == "cuda":
            enable_flight_recorder()
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                device_id=device if device.type == "cuda" else None, store=store,
                                rank=rank(), world_size=world_size)
        watchdog.start(timeout_s=train.dist_timeout_s, log_path=ensure_rank_log(None, rank()))
    return device


def enable_flight_recorder() -> None:
    """NCCL's flight recorder: the last collectives of every rank (op, sizes, state), dumped when one
    times out. Read when the NCCL group is created; a user's own settings win."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def report_hangs_in(run_dir: Path) -> None:
    """Once run_dir is known: the watchdog's stack dumps go to run_dir/logs/rank<N>.log and the flight
    recorder's to run_dir/logs/nccl_trace_rank_<N> (torch reads the name at its first dump; older
    versions the second variable)."""
    watchdog.log_to(ensure_rank_log(run_dir, rank()))
    for variable in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        os.environ.setdefault(variable, str(run_dir / "logs" / "nccl_trace_rank_"))
