"""Forked gloo ranks for a test of one function that runs collectives.

Forked, not spawned: each rank starts from the test process's imports instead of importing torch
again, and takes a function defined inside the test module without pickling it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable


def _as_rank(rank: int, target: Callable[[int], None], port: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        target(rank)
    finally:
        dist.destroy_process_group()


def fork_gloo_ranks(target: Callable[[int], None], world: int = 2) -> None:
    """``target(rank)`` on ``world`` forked ranks of one gloo process group; a rank's exception
    fails the call."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_as_rank, args=(target, port, world), nprocs=world, start_method="fork")
