"""Context parallelism: attention across cp ranks equals one process's attention (forward and
backward, GQA, document masks), and whole training runs with cp reproduce one process.

The attention checks run in one spawned gloo group per cp degree (no torchrun, no model); the
training layouts share the conftest ``parity`` reference runs.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness.parity import Matrix, layouts, prefetch_selected

from parallel3d.parallel.context import ContextParallelAttention, local_attention, shard_positions, shard_sequence


@pytest.mark.fast
def test_head_tail_shards_cover_the_sequence_once_and_balance_causal_work():
    seq, cp = 16, 4
    x = torch.arange(seq)[None]
    shards = [shard_sequence(x, r, cp) for r in range(cp)]
    assert shards[1].tolist() == [[2, 3, 12, 13]]
    assert sorted(torch.cat(shards, 1)[0].tolist()) == list(range(seq))
    for r, shard in enumerate(shards):
        assert torch.equal(shard_positions(seq // cp, r, cp), shard[0])
    # causal work of a rank: keys each of its queries sees (position + 1), equal on every rank
    assert len({int((shard + 1).sum()) for shard in shards}) == 1


# (heads, kv heads, with document ids): plain MHA, GQA with kv heads < cp, one kv head
# (heads, kv heads, documents, value width): the last, values narrower than q/k, is MLA's case
CASES = [(4, 4, False, 8), (4, 2, True, 8), (4, 1, False, 8), (8, 2, True, 8), (4, 4, True, 6)]


def _attention_worker(rank: int, world: int, port: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        for method in ("alltoall", "ring"):
            attend = ContextParallelAttention(mesh, method)
            for h, hk, docs, dv in CASES:
                _check_case(attend, rank, world, h, hk, docs, dv, f"{method} h={h} hk={hk} docs={docs} dv={dv}")
    finally:
        dist.destroy_process_group()


def _check_case(attend, rank, cp, h, hk, docs, dv, label):
    g = torch.Generator().manual_seed(h * 10 + hk)
    b, s, d = 2, 8 * cp, 8
    q, k, v = (torch.randn(b, n, s, width, generator=g, dtype=torch.float64) for n, width in ((h, d), (hk, d), (hk, dv)))
    dout = torch.randn(b, h, s, dv, generator=g, dtype=torch.float64)
    doc_ids = torch.randint(0, 3, (b, s), generator=g).sort(dim=1).values if docs else None
    for t in (q, k, v):
        t.requires_grad_(True)
    ref = local_attention(q, k, v, doc_ids)
    ref.backward(dout)
    local = [shard_sequence(t.detach(), rank, cp, dim=2).requires_grad_(True) for t in (q, k, v)]
    out = attend(*local, shard_sequence(doc_ids, rank, cp) if docs else None)
    out.backward(shard_sequence(dout, rank, cp, dim=2))
    torch.testing.assert_close(out, shard_sequence(ref.detach(), rank, cp, dim=2), msg=label)
    for name, mine, full in zip("qkv", local, (q, k, v)):
        torch.testing.assert_close(mine.grad, shard_sequence(full.grad, rank, cp, dim=2), msg=f"{label} d{name}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_matches_one_process_forward_and_backward(cp):
    """Both methods, float64, outputs and q/k/v gradients: a failing rank's assertion propagates."""
    mp.spawn(_attention_worker, args=(cp, _free_port()), nprocs=cp, join=True)


# name: (ranks, overrides). Both methods where they run; DDP (zero_stage 0) must average over cp too.
LAYOUTS = layouts({
    "cp2-alltoall": (2, ["parallel.cp=2", "parallel.cp_method=alltoall", "train.micro_batch_size=8"]),
    "cp2-ring-ddp": (2, ["parallel.cp=2", "parallel.cp_method=ring", "parallel.zero_stage=0",
                         "train.micro_batch_size=4"]),
    "cp4-ring": (4, ["parallel.cp=4", "parallel.cp_method=ring", "train.micro_batch_size=8"]),
    "cp4-alltoall-zero1": (4, ["parallel.cp=4", "parallel.cp_method=alltoall", "parallel.zero_stage=1",
                               "train.micro_batch_size=8"]),
    "cp2-tp2-alltoall": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.cp_method=alltoall",
                             "train.micro_batch_size=8"]),
    "cp2-tp2-ring": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.cp_method=ring", "train.micro_batch_size=8"]),
    "cp2-pp2-ring": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.cp_method=ring", "train.micro_batch_size=4"]),
    "dp2-cp2-zero3-alltoall": (4, ["parallel.cp=2", "parallel.dp_shard=2", "parallel.zero_stage=3",
                                   "parallel.cp_method=alltoall", "train.micro_batch_size=4"]),
})
MATRIX = Matrix(tuple(LAYOUTS))  # lent to other files' batches (harness/parity.py)


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py)."""
    prefetch_selected(request, parity, MATRIX)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_cp_layouts_train_like_one_process(layout, parity):
    """Losses, grad norms and final weights within 1e-5 of one process; Parity.run also holds the
    planner's model-state bytes (FSDP over dp_shard x cp) to what the run measured."""
    run = parity.train(layout)
    parity.assert_same_training(run)
    assert "cp" in run.stdout, run.stdout[-500:]  # the banner names the mesh it ran on
