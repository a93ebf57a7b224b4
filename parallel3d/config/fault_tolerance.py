"""The ``ft.*`` keys: their checks (before any process group) and the share of the global batch a
replica group trains.

Under fault tolerance each replica group is its own torchrun job (parallel3d/ft/). The global batch
stays fixed: it is cut into ``ft.replicas`` slices and group ``ft.replica_id`` trains slice
``replica_id``, split further over its own data-parallel ranks exactly as HSDP's replicas split it.
A step trains the slices of the groups in its quorum; the slices of absent groups are dropped and
named in ``run_dir/ft/membership.jsonl`` (docs/fault-tolerance.md says why not redistributed).
"""

from __future__ import annotations

import importlib.util
import os
from urllib.parse import urlparse

from parallel3d.base import ConfigError

SEMI_SYNC = ("none", "diloco")
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


def batch_share(c) -> tuple[int, int]:
    """(this group's slice, slices of the global batch): (0, 1) without fault tolerance."""
    return (c.ft.replica_id, c.ft.replicas) if c.ft.enabled else (0, 1)


def lighthouse_address(ft) -> str | None:
    """``ft.lighthouse``, else the environment's $TORCHFT_LIGHTHOUSE (torchft's own variable)."""
    return ft.lighthouse or os.environ.get(LIGHTHOUSE_ENV) or None


def check_ft(cfg) -> None:
    """Raise ConfigError for ``ft.*`` keys that cannot run (nothing when ft.enabled is false)."""
    ft, t, p = cfg.ft, cfg.train, cfg.parallel
    if not ft.enabled:
        if cfg.debug.ft_fail_steps or cfg.debug.ft_alone_sleep_s:
            key = "debug.ft_fail_steps" if cfg.debug.ft_fail_steps else "debug.ft_alone_sleep_s"
            raise ConfigError(key, cfg.debug.ft_fail_steps or cfg.debug.ft_alone_sleep_s, "a fault-tolerance test key",
                              "set ft.enabled=true, or remove it")
        return
    if cfg.debug.ft_alone_sleep_s < 0:
        raise ConfigError("debug.ft_alone_sleep_s", cfg.debug.ft_alone_sleep_s, "must be >= 0", "use seconds, or 0")
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("ft.enabled", True, "torchft is not installed",
                          "pip install 'parallel3d[ft]' (torchft 0.2.0), or ft.enabled=false")
    _check_lighthouse(lighthouse_address(ft))
    if ft.replicas < 1:
        raise ConfigError("ft.replicas", ft.replicas, "must be >= 1", "use the number of replica groups of the run")
    if not 0 <= ft.replica_id < ft.replicas:
        raise ConfigError("ft.replica_id", ft.replica_id, f"outside 0..{ft.replicas - 1} (ft.replicas={ft.replicas})",
                          "give each replica group its own id from 0 to ft.replicas-1")
    if not 1 <= ft.min_replicas <= ft.replicas:
        raise ConfigError("ft.min_replicas", ft.min_replicas, f"outside 1..ft.replicas={ft.replicas}",
                          "use how many groups a step needs at least (1: train on while any group lives)")
    if ft.semi_sync not in SEMI_SYNC:
        raise ConfigError("ft.semi_sync", ft.semi_sync, f"not one of {', '.join(SEMI_SYNC)}",
                          "use ft.semi_sync=none (every step) or diloco")
    if ft.semi_sync == "diloco":
        _check_diloco(ft.diloco, t.steps, cfg.checkpoint.every)
        if cfg.model.moe.num_experts and cfg.model.moe.router == "sigmoid":
            raise ConfigError("model.moe.router", "sigmoid", "its balancing bias is not a parameter: DiLoCo's "
                              "syncs would leave each group its own", "use ft.semi_sync=none with the sigmoid router")
    for key in ("timeout_s", "quorum_timeout_s", "connect_timeout_s"):
        if getattr(ft, key) <= 0:
            raise ConfigError(f"ft.{key}", getattr(ft, key), "must be > 0", "use seconds, e.g. 60")
    shares = ft.replicas * p.dp_replicate * p.dp_shard * t.micro_batch_size
    if t.global_batch_size % shares:
        raise ConfigError("train.global_batch_size", t.global_batch_size,
                          f"not divisible by ft.replicas={ft.replicas} x the group's data-parallel degree "
                          f"{p.dp_replicate * p.dp_shard} x train.micro_batch_size={t.micro_batch_size} = {shares}",
                          f"use a multiple of {shares}")
    if cfg.data.format != "text":
        raise ConfigError("data.format", cfg.data.format, "fault tolerance averages each group's mean loss, which "
                          "weighs instruction data's trained tokens unevenly", "use data.format=text with ft.enabled")
    if cfg.train.on_bad_step == "skip":
        raise ConfigError("train.on_bad_step", "skip", "its rollback after train.max_bad_steps loads one group's "
                          "checkpoint, which the other replica groups do not have",
                          "use train.on_bad_step=stop with ft.enabled")

def _check_diloco(d, steps: int, every: int) -> None:
    h = d.inner_steps
    if h < 1:
        raise ConfigError("ft.diloco.inner_steps", h, "must be >= 1", "use the local steps between syncs, e.g. 20")
    if steps % h:
        raise ConfigError("train.steps", steps, f"not a multiple of ft.diloco.inner_steps={h}: the run would end "
                          "between two syncs, the groups apart", f"use a multiple of {h}")
    if every % h:
        raise ConfigError("checkpoint.every", every, f"not a multiple of ft.diloco.inner_steps={h}: a checkpoint "
                          "between syncs would hold one group's local weights", f"use a multiple of {h}")
    if not d.outer_lr > 0 or not 0 <= d.outer_momentum < 1:
        key, value = ("ft.diloco.outer_lr", d.outer_lr) if not d.outer_lr > 0 else \
            ("ft.diloco.outer_momentum", d.outer_momentum)
        raise ConfigError(key, value, "outside its range (outer_lr > 0, 0 <= outer_momentum < 1)",
                          "use DiLoCo's outer_lr=0.7 outer_momentum=0.9")


def _check_lighthouse(address: str | None) -> None:
    if not address:
        raise ConfigError("ft.lighthouse", None, f"no lighthouse to form quorums (nor ${LIGHTHOUSE_ENV})",
                          "start `parallel3d-lighthouse --min-replicas N --port P` and pass the address it prints")
    url = urlparse(address)
    if url.scheme not in ("http", "https") or not url.hostname or url.port is None:
        raise ConfigError("ft.lighthouse", address, "not an address like http://HOST:PORT",
                          "pass the address parallel3d-lighthouse printed")
