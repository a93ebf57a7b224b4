"""torchft's lighthouse: the one small server the replica groups ask for each step's quorum.

It holds no training state: it keeps the groups' heartbeats and decides who forms the next quorum
(at least ``min_replicas``; a group silent for ``heartbeat_timeout_ms`` is left out, a new one waits
up to ``join_timeout_ms`` to be let in). Losing it stops the quorums, not the state: the groups
stop with one line each and a restarted lighthouse takes restarted groups (docs/fault-tolerance.md).
"""

from __future__ import annotations

import socket
from urllib.parse import urlparse

from parallel3d.ft import FTError


def start_lighthouse(*, min_replicas: int, port: int, join_timeout_ms: int, heartbeat_timeout_ms: int,
                     quorum_tick_ms: int):
    """A running LighthouseServer on ``port`` (0: any free one); its ``address()`` is the URL to pass
    as ``ft.lighthouse``."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms, quorum_tick_ms=quorum_tick_ms)


def check_reachable(address: str, *, timeout_s: float) -> None:
    """Raise FTError (one line) unless something listens at the lighthouse's ``address``; every
    rank checks before torchft's manager would wait on it."""
    url = urlparse(address)
    try:
        with socket.create_connection((url.hostname, url.port), timeout=timeout_s):
            return
    except OSError as e:
        raise FTError(f"ft.lighthouse={address}: no lighthouse answers ({e.strerror or e}) within "
                       f"ft.connect_timeout_s={timeout_s:g}. Fix: start `parallel3d-lighthouse --min-replicas N "
                       f"--port P` first and pass the address it prints") from None
