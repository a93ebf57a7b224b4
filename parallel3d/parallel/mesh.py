"""Parallel degrees and the one DeviceMesh they describe.

The world is laid out as (pp, dp_replicate, dp_shard, cp, tp), outermost first: tp ranks are
neighbours (same node, fastest links), then the context-parallel ranks that split each sequence,
pipeline stages are furthest apart. Dimensions of size 1
are left out of the mesh entirely, so a layout pays only for the process groups it uses.

    8 ranks, pp=2 dp_shard=2 tp=2:          rank = ((pp * dp_replicate + r) * dp_shard + s) * tp + t
        pp0: dp0 [0 1]  dp1 [2 3]           (tp pairs in brackets)
        pp1: dp0 [4 5]  dp1 [6 7]

cp ranks hold the same parameters (they split the sequence, not the model), so FSDP shards over
dp_shard x cp and gradients are averaged over every data-parallel and cp rank (``dp_cp``).

Mixed precision is FSDP's in every layout (``parallel/data.py``): where no other rank holds this
rank's parameters (dp x cp = 1) and parameters compute in a lower precision, the mesh keeps a
dp_shard dimension of size 1 (``Meshes.precision``) for that cast to run on, and one process
starts a process group of one rank for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int = field(default=1, kw_only=True)  # context parallel: ranks that split each sequence

    @classmethod
    def from_config(cls, parallel) -> "ParallelDims":
        """From a validated ParallelConfig (dp_shard already resolved from -1)."""
        return cls(parallel.dp_replicate, parallel.dp_shard, parallel.tp, parallel.pp, cp=parallel.cp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def sizes(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}


@dataclass
class Meshes:
    """The world mesh and the views of it that the rest of the program needs.

    A view is None when its dimension has size 1: nothing to parallelize there.
    """

    world: Optional[DeviceMesh]
    dp: Optional[DeviceMesh] = None  # all data-parallel ranks, flattened: data slicing, loss averaging, DDP, ZeRO-1
    fsdp: Optional[DeviceMesh] = None  # what fully_shard gets: dp_shard (x cp) (1D) or (dp_replicate, that) for HSDP
    # Ranks that hold the same parameters: dp x cp, flattened (= dp without cp). Gradients and
    # the loss are averaged over it; DDP and ZeRO-1 run on it.
    dp_cp: Optional[DeviceMesh] = None
    cp: Optional[DeviceMesh] = None
    tp: Optional[DeviceMesh] = None
    pp: Optional[DeviceMesh] = None
    # The ranks that split each sequence's tokens: cp x tp, flattened (under sequence parallelism
    # tp ranks hold sequence shards too). Token-local layers (MoE routing) reduce over it.
    cp_tp: Optional[DeviceMesh] = None
    # expert parallel: ep consecutive ranks of dp_shard x cp x tp (parallel/expert.py)
    ep: Optional[DeviceMesh] = None
    expert_dp: Optional[DeviceMesh] = None  # the dp x cp x tp ranks holding the same experts (/ ep of them)
    # This rank alone, for FSDP's mixed-precision cast where dp x cp = 1 (the module docstring).
    precision: Optional[DeviceMesh] = None

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank() if self.dp is not None else 0

    @property
    def data_parallel(self) -> Optional[DeviceMesh]:
        """The mesh the data-parallel wrapper (FSDP or replicate) runs on, if there is one."""
        return self.dp_cp if self.dp_cp is not None else self.precision


def build_mesh(dims: ParallelDims, device_type: str, ep: int = 1, mixed_precision: bool = False) -> Meshes:
    """One DeviceMesh over all ranks with the dimensions of size > 1, plus its named views.
    ``ep`` (dividing dp_shard x cp x tp) splits the flattened (dp, cp, tp) ranks into
    (expert_dp, ep), ep innermost. ``mixed_precision`` (parameters compute below float32):
    without data parallelism, a dp_shard dimension of size 1 as well, ``Meshes.precision``."""
    precision = mixed_precision and dims.dp * dims.cp == 1
    active = [(name, size) for name, size in dims.sizes().items() if size > 1 or (precision and name == "dp_shard")]
    if not active:
        return Meshes(world=None)
    if precision and not dist.is_initialized():  # one process: FSDP needs a group, of one rank
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    world = init_device_mesh(device_type, tuple(size for _, size in active),
                             mesh_dim_names=tuple(name for name, _ in active))
    meshes = Meshes(world=world, precision=world["dp_shard"] if precision else None)
    return _views(meshes, dims, ep, tuple(name for name, size in active if size > 1))


def _views(meshes: Meshes, dims: ParallelDims, ep: int, names: tuple[str, ...]) -> Meshes:
    """The named views of ``meshes.world`` over its dimensions ``names`` (those of size > 1)."""
    world = meshes.world
    dp_names = tuple(name for name in ("dp_replicate", "dp_shard") if name in names)
    if dp_names:
        meshes.dp = _flat(world, dp_names, "dp")
    if "cp" in names:
        meshes.cp = world["cp"]
    meshes.dp_cp = _flat(world, (*dp_names, "cp"), "dp_cp") if "cp" in names else meshes.dp
    # FSDP shards over dp_shard (x cp), and replicates those shards over dp_replicate (HSDP).
    shard_names = tuple(name for name in ("dp_shard", "cp") if name in names)
    if shard_names:
        shard = _flat(world, shard_names, "dp_shard_cp")
        if "dp_replicate" in names:
            meshes.fsdp = world[("dp_replicate", shard.mesh_dim_names[0])]
        else:
            meshes.fsdp = shard
    elif dp_names:
        meshes.fsdp = world[dp_names]
    if "tp" in names:
        meshes.tp = world["tp"]
    if "pp" in names:
        meshes.pp = world["pp"]
    token_names = tuple(name for name in ("cp", "tp") if name in names)
    if token_names:
        meshes.cp_tp = _flat(world, token_names, "cp_tp")
    if ep > 1:
        pool_names = tuple(name for name in ("dp_replicate", "dp_shard", "cp", "tp") if name in names)
        pool = meshes.dp if pool_names == dp_names else _flat(world, pool_names, "dp_cp_tp")
        split = pool._unflatten(0, (pool.size() // ep, ep), ("expert_dp", "ep"))
        meshes.ep = split["ep"]
        if pool.size() > ep:
            meshes.expert_dp = split["expert_dp"]
            # The experts' FSDP units make them DTensors over (expert_dp, ep): registered flat, DTensor
            # reduces their gradient norm in one all-reduce, not one per dim.
            split[("expert_dp", "ep")]._flatten("expert_dp_ep")
    return meshes


def _flat(world: DeviceMesh, names: tuple[str, ...], flat_name: str) -> DeviceMesh:
    """The named dims of ``world`` as one dim (itself when it is one already)."""
    return world[names] if len(names) == 1 else world[names]._flatten(flat_name)
