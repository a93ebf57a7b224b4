"""ParallelDims arithmetic and the DeviceMesh that build_mesh lays out (on a fake 16-rank group)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from omegaconf import OmegaConf

from parallel3d.config.schema import ParallelConfig
from parallel3d.parallel.mesh import MESH_DIMS, Meshes, ParallelDims, build_mesh


def test_parallel_dims_dp_and_world_size():
    dims = ParallelDims(dp_replicate=2, dp_shard=3, tp=5, pp=7)
    assert dims.dp == 2 * 3
    assert dims.world_size == 2 * 3 * 5 * 7
    assert dims.sizes() == {"pp": 7, "dp_replicate": 2, "dp_shard": 3, "cp": 1, "tp": 5}
    assert list(dims.sizes()) == list(MESH_DIMS)  # outermost first


def test_parallel_dims_from_config():
    dims = ParallelDims.from_config(ParallelConfig(dp_replicate=2, dp_shard=4, tp=3, pp=5))
    assert dims == ParallelDims(dp_replicate=2, dp_shard=4, tp=3, pp=5)
    # A composed (OmegaConf) config works the same as the dataclass.
    node = OmegaConf.structured(ParallelConfig(dp_replicate=3, dp_shard=2, tp=1, pp=2))
    assert ParallelDims.from_config(node) == ParallelDims(3, 2, 1, 2)


def test_build_mesh_single_rank_needs_no_process_group():
    meshes = build_mesh(ParallelDims(1, 1, 1, 1), "cpu")
    assert meshes == Meshes(world=None)
    assert meshes.dp is None and meshes.fsdp is None and meshes.tp is None and meshes.pp is None
    assert meshes.dp_rank == 0


@pytest.fixture
def fake_world():
    """A 16-rank fake process group in this process, torn down after the test."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int = 0, world_size: int = 16) -> None:
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())

    try:
        yield init
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _coords(rank: int, dims: ParallelDims) -> dict[str, int]:
    """The mesh.py docstring's layout: rank = ((pp * dp_replicate + r) * dp_shard + s) * tp + t."""
    coords = {}
    for name in reversed(MESH_DIMS):
        size = getattr(dims, name)
        rank, coords[name] = divmod(rank, size)
    return coords


@pytest.mark.fast
def test_build_mesh_4d(fake_world):
    fake_world(rank=0)
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    meshes = build_mesh(dims, "cpu")
    assert meshes.world.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
    assert tuple(meshes.world.mesh.shape) == (2, 2, 2, 2)
    assert meshes.dp.size() == 4
    assert meshes.fsdp.ndim == 2
    assert meshes.fsdp.mesh_dim_names == ("dp_replicate", "dp_shard")
    assert tuple(meshes.fsdp.mesh.shape) == (2, 2)
    assert meshes.tp.size() == 2
    assert meshes.pp.size() == 2
    assert meshes.dp_rank == 0


@pytest.mark.parametrize("rank", [5, 10, 15])
def test_build_mesh_rank_coordinates_follow_documented_layout(fake_world, rank):
    fake_world(rank=rank)
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=2)
    meshes = build_mesh(dims, "cpu")
    c = _coords(rank, dims)
    assert tuple(meshes.world.get_coordinate()) == (c["pp"], c["dp_replicate"], c["dp_shard"], c["tp"])
    assert meshes.tp.get_local_rank() == c["tp"]
    assert meshes.pp.get_local_rank() == c["pp"]
    # The flattened dp view counts replicas outermost, shards inside them.
    assert meshes.dp_rank == c["dp_replicate"] * dims.dp_shard + c["dp_shard"]
    # The tp pair of this rank are neighbours.
    assert meshes.tp.mesh.tolist() == [rank - c["tp"], rank - c["tp"] + 1]


def test_build_mesh_drops_size_one_dims(fake_world):
    fake_world(rank=0)
    meshes = build_mesh(ParallelDims(dp_replicate=1, dp_shard=8, tp=1, pp=2), "cpu")
    assert meshes.world.mesh_dim_names == ("pp", "dp_shard")
    assert "tp" not in meshes.world.mesh_dim_names and "dp_replicate" not in meshes.world.mesh_dim_names
    assert meshes.tp is None
    assert meshes.fsdp.ndim == 1 and meshes.fsdp.mesh_dim_names == ("dp_shard",)
    assert meshes.dp.size() == 8
    assert meshes.pp.size() == 2


def test_build_mesh_pure_tp_has_no_dp_views(fake_world):
    fake_world(rank=3)
    meshes = build_mesh(ParallelDims(dp_replicate=1, dp_shard=1, tp=16, pp=1), "cpu")
    assert meshes.world.mesh_dim_names == ("tp",)
    assert meshes.dp is None and meshes.fsdp is None and meshes.pp is None
    assert meshes.dp_rank == 0
    assert meshes.tp.get_local_rank() == 3


@pytest.mark.parametrize("rank", [0, 6, 13])
def test_cp_sits_between_dp_shard_and_tp_and_fsdp_shards_over_dp_shard_x_cp(fake_world, rank):
    """16 ranks, pp=2 dp_replicate=1 dp_shard=2 cp=2 tp=2 (docs/context_parallel.md's picture)."""
    fake_world(rank=rank)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=2, cp=2)
    assert dims.world_size == 16 and dims.dp == 2
    meshes = build_mesh(dims, "cpu")
    assert meshes.world.mesh_dim_names == ("pp", "dp_shard", "cp", "tp")
    c = _coords(rank, dims)
    assert meshes.cp.get_local_rank() == c["cp"] and meshes.dp_rank == c["dp_shard"]
    base = rank - c["dp_shard"] * 4 - c["cp"] * 2  # the (pp, tp) coordinate's first member
    same_params = sorted(base + d * 4 + k * 2 for d in range(2) for k in range(2))
    assert meshes.fsdp.mesh_dim_names == ("dp_shard_cp",) and meshes.fsdp.mesh.tolist() == same_params
    assert meshes.dp_cp.mesh_dim_names == ("dp_cp",) and meshes.dp_cp.mesh.tolist() == same_params
    assert meshes.dp.mesh.tolist() == [base + c["cp"] * 2 + d * 4 for d in range(2)]  # data: dp only


@pytest.mark.fast
@pytest.mark.parametrize("rank", [0, 5])
def test_ep_borrows_tp_then_cp_then_dp_shard_ranks(fake_world, rank):
    """8 ranks, dp_shard=2 cp=2 tp=2: ep neighbours are consecutive ranks of dp_shard x cp x tp
    (ep2: the tp pair; ep4: cp x tp), expert_dp the rest; cp_tp the ranks that split a sequence."""
    fake_world(rank=rank, world_size=8)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=1, cp=2)
    first = rank // 2 * 2
    meshes = build_mesh(dims, "cpu", ep=2)
    assert meshes.ep.mesh.tolist() == [first, first + 1] and meshes.tp.mesh.tolist() == [first, first + 1]
    assert meshes.expert_dp.mesh.tolist() == [rank % 2 + 2 * i for i in range(4)]
    assert meshes.cp_tp.mesh.tolist() == [rank // 4 * 4 + i for i in range(4)]
    meshes = build_mesh(dims, "cpu", ep=4)
    assert meshes.ep.mesh.tolist() == meshes.cp_tp.mesh.tolist()
    assert meshes.expert_dp.mesh.tolist() == [rank % 4, rank % 4 + 4]


def test_hsdp_with_cp_replicates_the_dp_shard_x_cp_shards(fake_world):
    fake_world(rank=0)
    meshes = build_mesh(ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=1, cp=2), "cpu")
    assert meshes.fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    assert tuple(meshes.fsdp.mesh.shape) == (2, 4) and meshes.dp_cp.size() == 8 and meshes.dp.size() == 4
