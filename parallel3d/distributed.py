"""The process group: one per run, over gloo (CPU) or NCCL (CUDA), with a timeout."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel3d.base import resolve_device
from parallel3d.rundir import rank


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
    if world_size > 1 and not dist.is_initialized():  # a caller's own group (tests/layout_batch.py) is kept
        timeout = timedelta(seconds=train.dist_timeout_s)
        store = attempt_store(timeout)  # None: torch's env:// rendezvous, as before
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                device_id=device if device.type == "cuda" else None, store=store,
                                rank=rank(), world_size=world_size)
    return device
