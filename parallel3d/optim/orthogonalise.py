"""Muon's Newton–Schulz shared out over the ranks that hold pieces of a matrix.

FSDP and tensor parallelism leave a block matrix in pieces on a group of ranks: the mesh dims
whose placement splits one of its two dims (:func:`sharing_dims`). Newton–Schulz needs it whole.
Each rank of the group orthogonalises a share of the group's matrices, whole: the owners are
chosen once, largest Newton–Schulz cost first to the least loaded rank (:func:`owners`). Then,
per optimizer step and group:

1. one all-to-all sends every piece (in bfloat16, which Newton–Schulz casts to first) to its
   matrix's owner, which puts its matrices together;
2. each owner orthogonalises its matrices;
3. one all-to-all sends every rank its pieces of the results.

A rank of a group of n sends about 2(n-1)/n² of the group's matrices' bytes and runs 1/n of the
Newton–Schulz work (gathering every matrix on every rank instead sends (n-1)/n and repeats all
of it on each rank). The owner orthogonalises the very matrix one process would: the update is
one process's, bit for bit. Matrices no rank splits (one process, pipeline stages, experts split
along the expert dim) are orthogonalised where they lie. Replicas (DDP, HSDP's dp_replicate)
each orthogonalise their own copy: sharing among them would send every result where now
nothing travels.

Why our own code: ``torch.optim.Muon`` takes whole tensors on one device, and DTensor's
redistribution gathers a matrix on every rank of a mesh dim (each then repeats Newton–Schulz) but
sends nothing to one owner. Which rows and columns a rank holds (:func:`held_piece`) follows
DTensor's layout: a ``Shard`` is a ``torch.chunk`` of its dim, a ``_StridedShard`` (FSDP over a
tensor-parallel split of the same dim) ``split_factor`` chunks, each chunked again.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel3d.base import is_dtensor

# (start, stop) index ranges along one dim of a matrix, in the order a rank's piece holds them.
Runs = tuple[tuple[int, int], ...]
Orthogonalise = Callable[[torch.Tensor, int], torch.Tensor]  # (whole matrix, item index) -> result


def _chunk(length: int, n: int, index: int) -> tuple[int, int]:
    """Chunk ``index`` of ``n`` of ``length`` positions, as torch.chunk sizes them."""
    size = -(-length // n)
    return min(size * index, length), min(size * (index + 1), length)


def _slice(runs: Runs, start: int, stop: int) -> list[tuple[int, int]]:
    """Positions start..stop of the index sequence that ``runs`` spell out, as runs."""
    out, offset = [], 0
    for a, b in runs:
        lo, hi = max(start, offset), min(stop, offset + b - a)
        if lo < hi:
            out.append((a + lo - offset, a + hi - offset))
        offset += b - a
    return out


def split_runs(runs: Runs, placement, n: int, index: int) -> Runs:
    """The indices rank ``index`` of ``n`` keeps when ``placement`` splits a dim holding ``runs``."""
    from torch.distributed.tensor.placement_types import _StridedShard

    length = sum(b - a for a, b in runs)
    if not isinstance(placement, _StridedShard):
        return tuple(_slice(runs, *_chunk(length, n, index)))
    out: list[tuple[int, int]] = []
    factor = int(placement.split_factor)
    for j in range(factor):
        lo, hi = _chunk(length, factor, j)
        a, b = _chunk(hi - lo, n, index)
        out.extend(_slice(runs, lo + a, lo + b))
    return tuple(out)


def _splits(placement) -> bool:
    from torch.distributed.tensor import Shard  # a placement exists: DTensor is imported already
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, (Shard, _StridedShard))


def held_piece(shape: Sequence[int], placements: Sequence, mesh_shape: Sequence[int],
               coordinate: Sequence[int]) -> tuple[Runs, Runs]:
    """The rows and columns of each matrix (the last two dims of the global ``shape``) that the
    rank at mesh ``coordinate`` holds, placements applied left to right as DTensor does."""
    leading = len(shape) - 2
    runs: list[Runs] = [((0, shape[-2]),), ((0, shape[-1]),)]
    for dim, placement in enumerate(placements):
        if _splits(placement) and placement.dim >= leading:
            at = placement.dim - leading
            runs[at] = split_runs(runs[at], placement, mesh_shape[dim], coordinate[dim])
    return runs[0], runs[1]


def sharing_dims(param: torch.Tensor) -> tuple[int, ...]:
    """The mesh dims (of more than one rank) that split a matrix dim of ``param``: its pieces'
    holders. Empty: every rank holds its matrices whole (a split of the leading, expert dim
    leaves each expert whole)."""
    if not is_dtensor(param):
        return ()
    mesh, leading = param.device_mesh, param.ndim - 2
    return tuple(d for d, pl in enumerate(param.placements) if _splits(pl) and pl.dim >= leading and mesh.size(d) > 1)


def newton_schulz_cost(rows: int, cols: int) -> int:
    """Multiply-adds of one Newton–Schulz iteration on a rows x cols matrix, up to a factor:
    with s the smaller side and l the larger, X Xᵀ and its product with X (s²l each) and its
    square (s³)."""
    small, large = sorted((rows, cols))
    return small * small * (2 * large + small)


def owners(shapes: Sequence[tuple[int, int]], n: int) -> list[int]:
    """Which of ``n`` ranks orthogonalises each matrix: largest cost first (then larger, then
    earlier) to the rank with the least cost so far (then the lowest). Deterministic, and the
    bytes each rank owns depend only on the shapes, not on their order (the planner's count)."""
    costs = [newton_schulz_cost(*shape) for shape in shapes]
    loads, out = [(0, r) for r in range(n)], [0] * len(shapes)  # a heap of (cost so far, rank)
    for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], -math.prod(shapes[i]), i)):
        load, owner = heapq.heappop(loads)
        out[i] = owner
        heapq.heappush(loads, (load + costs[i], owner))
    return out


def _numel(piece: tuple[Runs, Runs]) -> int:
    rows, cols = piece
    return sum(b - a for a, b in rows) * sum(b - a for a, b in cols)


def _put(whole: torch.Tensor, piece: tuple[Runs, Runs], flat: torch.Tensor) -> None:
    """Write a rank's piece (flattened, as it holds it) into its place in ``whole``."""
    rows, cols = piece
    block = flat.view(sum(b - a for a, b in rows), sum(b - a for a, b in cols))
    r = 0
    for a, b in rows:
        c = 0
        for d, e in cols:
            whole[a:b, d:e] = block[r:r + b - a, c:c + e - d]
            c += e - d
        r += b - a


def _take(whole: torch.Tensor, piece: tuple[Runs, Runs]) -> torch.Tensor:
    """A rank's piece of ``whole``, flattened in the order it holds it."""
    rows, cols = piece
    if _numel(piece) == 0:
        return whole.new_empty(0)
    return torch.cat([torch.cat([whole[a:b, d:e] for d, e in cols], 1) for a, b in rows]).reshape(-1)


def _stack(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a stack of matrices (one for a matrix; an empty piece's zero size stays explicit)."""
    return t.reshape(math.prod(t.shape[:-2]), *t.shape[-2:])


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_empty(0)


@dataclass
class _Unit:
    item: int  # index of the parameter among the exchange's items
    matrix: int  # index of the matrix in the parameter's local stack
    shape: tuple[int, int]
    owner: int  # group rank
    pieces: list[tuple[Runs, Runs]]  # each group rank's piece


@dataclass
class _Exchange:
    """One group's matrices of a step: who owns which, and how many elements go where."""
    group: dist.ProcessGroup
    me: int
    units: list[_Unit]  # by owner, then in parameter order: the order of the forward exchange
    send: list[int]  # elements to each group rank (forward), as many come back
    recv: list[int]  # elements from each group rank (forward), as many go back

    @property
    def mine(self) -> list[_Unit]:
        return [u for u in self.units if u.owner == self.me]


_GROUPS: dict[tuple[int, ...], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}  # ranks -> (world, group)


def _group(mesh, dims: tuple[int, ...], ranks: list[int]) -> dist.ProcessGroup:
    """The process group of ``ranks``: the mesh's own for one dim; for several (FSDP x tp), one
    made once by its members alone (every member calls it at the same step: they hold the same
    parameters), named like the planner's group."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    key = tuple(sorted(ranks))
    world, group = _GROUPS.get(key, (None, None))
    if world is not dist.group.WORLD:  # none yet, or one of a process group since destroyed
        names = mesh.mesh_dim_names or tuple(f"dim{d}" for d in range(mesh.ndim))
        group = dist.new_group(list(key), use_local_synchronization=True,
                               group_desc="_".join(names[d] for d in dims))
        _GROUPS[key] = (dist.group.WORLD, group)
    return group


def _members(mesh, dims: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
    """(mesh coordinate, global rank) of every rank that differs from this one along ``dims``
    only. A mesh lays ranks out by strides: a step along one dim adds the same to every rank."""
    me, coordinate = dist.get_rank(), mesh.get_coordinate()
    along = {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in dims}
    if any(along[d][coordinate[d]] != me for d in dims):
        raise RuntimeError(f"Muon: mesh {mesh} does not order its ranks by coordinate; "
                           "parallel3d/optim/orthogonalise.py assumes it")
    out = []
    for combo in itertools.product(*(range(mesh.size(d)) for d in dims)):
        at, rank = list(coordinate), me
        for d, i in zip(dims, combo):
            at[d], rank = i, rank + along[d][i] - me
        out.append((tuple(at), rank))
    return out


def plan_exchange(params: list[torch.Tensor], dims: tuple[int, ...]) -> _Exchange:
    """The exchange of ``params`` (DTensors of one mesh, split along ``dims``) among their pieces' holders."""
    mesh = params[0].device_mesh
    members = _members(mesh, dims)
    group = _group(mesh, dims, [rank for _, rank in members])
    members.sort(key=lambda member: dist.get_group_rank(group, member[1]))
    me = dist.get_group_rank(group, dist.get_rank())
    units = []
    for item, p in enumerate(params):
        pieces = [held_piece(p.shape, p.placements, mesh.shape, at) for at, _ in members]
        local = p.to_local().shape
        if _numel(pieces[me]) != local[-2] * local[-1]:
            raise RuntimeError(f"Muon: a {tuple(p.shape)} parameter placed {p.placements} holds {tuple(local)} "
                               "here, not the piece parallel3d/optim/orthogonalise.py computes for it")
        units += [_Unit(item, m, tuple(p.shape[-2:]), 0, pieces) for m in range(math.prod(local[:-2]))]
    for unit, owner in zip(units, owners([u.shape for u in units], len(members))):
        unit.owner = owner
    units.sort(key=lambda u: u.owner)  # stable: parameter order within an owner
    send = [sum(_numel(u.pieces[me]) for u in units if u.owner == g) for g in range(len(members))]
    recv = [sum(_numel(u.pieces[s]) for u in units if u.owner == me) for s in range(len(members))]
    return _Exchange(group, me, units, send, recv)


def exchange(plan: _Exchange, updates: list[torch.Tensor], orthogonalise: Orthogonalise) -> list[torch.Tensor]:
    """Each local update's pieces to their owners, ``orthogonalise`` there, the results' pieces
    back: the orthogonalised local updates, shaped like ``updates``."""
    matrices = [_stack(u) for u in updates]
    send = _cat([matrices[u.item][u.matrix].reshape(-1) for u in plan.units], updates[0])
    recv = send.new_empty(sum(plan.recv))
    dist.all_to_all_single(recv, send, plan.recv, plan.send, group=plan.group)
    del send
    sources, at = recv.split(plan.recv), [0] * len(plan.recv)
    results = []
    for unit in plan.mine:
        whole = recv.new_empty(unit.shape)
        for s, piece in enumerate(unit.pieces):
            k = _numel(piece)
            _put(whole, piece, sources[s][at[s]:at[s] + k])
            at[s] += k
        results.append(orthogonalise(whole, unit.item))
    del recv, sources
    back = _cat([_take(r, u.pieces[s]) for s in range(len(plan.recv)) for u, r in zip(plan.mine, results)],
                updates[0])
    returned = back.new_empty(sum(plan.send))
    dist.all_to_all_single(returned, back, plan.send, plan.recv, group=plan.group)
    out = [torch.empty_like(m) for m in matrices]
    offset = 0
    for unit in plan.units:
        target = out[unit.item][unit.matrix]
        target.copy_(returned[offset:offset + target.numel()].view(target.shape))
        offset += target.numel()
    return [o.view(u.shape) for o, u in zip(out, updates)]


class SharedNewtonSchulz:
    """Orthogonalises a step's updates (local, bfloat16): each matrix whole, once, on one rank of
    the group that holds its pieces; the rest where they lie. Plans are made on the first step
    and kept (a parameter's shape and placement never change)."""

    def __init__(self):
        self._plans: dict[tuple[int, ...], _Exchange] = {}

    def __call__(self, params: list[torch.Tensor], updates: list[torch.Tensor],
                 orthogonalise: Orthogonalise) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(params)
        shared: dict[tuple, list[int]] = {}
        for i, (p, update) in enumerate(zip(params, updates)):
            dims = sharing_dims(p)
            if dims:
                shared.setdefault((p.device_mesh, dims), []).append(i)
            else:
                out[i] = _each_matrix(update, lambda m, i=i: orthogonalise(m, i))
        for (_, dims), items in shared.items():
            key = tuple(id(params[i]) for i in items)
            if key not in self._plans:
                self._plans[key] = plan_exchange([params[i] for i in items], dims)
            results = exchange(self._plans[key], [updates[i] for i in items],
                               lambda m, j, items=items: orthogonalise(m, items[j]))
            for i, result in zip(items, results):
                out[i] = result
        return out


def _each_matrix(whole: torch.Tensor, orthogonalise: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``orthogonalise`` on each matrix of ``whole`` (one, or a stack of experts'; maybe none:
    FSDP leaves a rank without experts when there are fewer than its ranks)."""
    matrices = _stack(whole).unbind()
    if not matrices:
        return whole
    return torch.stack([orthogonalise(m) for m in matrices]).reshape(whole.shape)
