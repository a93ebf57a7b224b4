"""Gradients after backward: placements settled once, and the global norm over every shard, clipped;
under the test-only ``debug.grad_noise``, perturbed by the size of float32 round-off first."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel3d.base import ConfigError, is_dtensor, local_tensor

# Above this a perturbation is no longer the size of float32 round-off (unit round-off 6e-8): the
# key would then measure something other than what the parity tests derive their tolerances from.
MAX_GRAD_NOISE = 1e-5


@torch.no_grad()
def settle_gradients(params) -> None:
    """Give each DTensor gradient its parameter's placements, once, after backward.

    Under tensor parallelism without a data-parallel wrapper (which does this as it reduces),
    autograd leaves the gradients of replicated weights (the norms, under sequence parallelism)
    ``Partial``: every later read (the norm, then each of AdamW's three uses) would all-reduce
    them again. A gradient that comes back whole where its parameter is sharded is cut to this
    rank's shard, a local slice.
    """
    for p in params:
        if is_dtensor(p.grad) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)


def check_grad_noise(debug, checkpoint, world_size: int) -> None:
    """ConfigErrors for debug.grad_noise: a perturbation of one process's gradients, for the parity
    tests' measurement of the reference's own sensitivity; refused where it could change real training."""
    noise = debug.grad_noise
    if noise == 0:
        return
    if not 0 < noise <= MAX_GRAD_NOISE:
        raise ConfigError("debug.grad_noise", noise, f"not a round-off-sized perturbation in (0, {MAX_GRAD_NOISE:g}]",
                          "use the size of float32 round-off, e.g. debug.grad_noise=1e-7, or 0 (off)")
    if world_size != 1:
        raise ConfigError("debug.grad_noise", noise, f"perturbs a one-process reference run, not {world_size} ranks",
                          "run the perturbed reference with one process, or set debug.grad_noise=0")
    if checkpoint.every or checkpoint.create_seed:
        raise ConfigError("debug.grad_noise", noise, "a perturbed run must not write checkpoints to resume from",
                          "set checkpoint.every=0 (and checkpoint.create_seed=false), or debug.grad_noise=0")


@torch.no_grad()
def perturb_gradients(params, *, relative: float, seed: int, draw: int, step: int) -> None:
    """debug.grad_noise: add to each gradient Gaussian noise of ``relative`` times its tensor's root
    mean square, drawn from a generator seeded by (``seed``, ``draw``, ``step``) in the parameters' order.

    Relative to the tensor, not to each element: a float32 sum taken in another order rounds by
    the size of the terms it sums, so an element that cancels to almost nothing (a gradient that is
    pure round-off) moves by as much as a large one. That is what layouts do to each other's
    gradients. An element that is exactly zero (the embedding row of a token no sequence of the
    batch holds) stays zero: a sum of zeros is zero in any order.
    """
    generator = torch.Generator().manual_seed((seed * 1_000_003 + draw) * 1_000_003 + step)
    for p in params:
        if p.grad is None:
            continue
        grad = local_tensor(p.grad)  # one rank: the whole tensor
        noise = torch.randn(grad.shape, generator=generator, dtype=torch.float32).to(grad.device)
        scale = grad.float().square().mean().sqrt() * relative
        grad.add_((noise * scale * (grad != 0)).to(grad.dtype))


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None, uncounted=()) -> torch.Tensor:
    """Clip to a global norm over every shard of every gradient; returns the norm before clipping
    (float64: see :func:`total_norm`).

    Sharded (DTensor) gradients give a partial norm per rank; ``full_tensor()`` reduces it over
    the mesh, so each rank clips by the same, global, value. (A rank's gradients are all DTensors
    or all plain tensors: parallel/tensor.py makes every tensor-parallel parameter a DTensor.)
    Under pipeline parallelism the squares of every stage's norm are summed over ``pp_group``.
    ``max_norm=0`` only measures. ``uncounted`` parameters (a second copy of a tied matrix) are
    clipped but not counted again.
    """
    with_grad = [p for p in params if p.grad is not None]  # torch's clip_grad_norm_ takes a generator too
    skip = {id(p) for p in uncounted}
    # DTensor ops take one mesh: expert-parallel experts live on the ep mesh, the rest on the dp one.
    by_mesh = _by_mesh([p for p in with_grad if id(p) not in skip])
    norms = [_mesh_norm([p.grad for p in group]) for group in by_mesh]
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if pp_group is not None:  # each pipeline rank holds other layers: add their squares
        norm = norm**2
        dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
        norm = norm.sqrt()
    if max_norm > 0:
        for group in _by_mesh(with_grad):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` as one vector, accumulated in float64 (a DTensor's: partial per rank).

    torch's ``get_total_norm`` sums the per-tensor norms in the gradients' dtype: in float32 its
    rounding depends on how many terms each rank sums, so layouts would clip by norms a few ulps
    apart, which AdamW at a small eps amplifies after a loss spike. In float64 every layout's norm
    agrees to float32 rounding."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64)))


def _mesh_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global norm of ``grads`` (one mesh's): when they are all split alike over one mesh dim
    (FSDP, ZeRO, HSDP's shards), this rank's norm of its local shards and one all-reduce of its
    square over that dim, as DTensor's partial norm reduces, without dispatching DTensor ops per
    gradient list; otherwise (tensor parallelism mixes placements) DTensor reduces it."""
    group = _split_group(grads)
    if group is False:
        norm = total_norm(grads)
        return norm.full_tensor() if is_dtensor(norm) else norm
    norm = total_norm([local_tensor(g) for g in grads])
    if group is None:  # whole on every rank (replicated, or one rank)
        return norm
    squared = norm**2
    dist.all_reduce(squared, group=group)
    return squared**0.5


def _split_group(grads: list[torch.Tensor]):
    """The process group of the one mesh dim that splits every gradient of ``grads`` alike; None
    where nothing is split (plain tensors, or replicated); False for any other layout."""
    from torch.distributed.tensor import Shard  # a DTensor exists: DTensor is imported already
    from torch.distributed.tensor.placement_types import Replicate

    if not grads or not is_dtensor(grads[0]):
        return None
    placements, mesh = grads[0].placements, grads[0].device_mesh
    if any(not is_dtensor(g) or g.placements != placements for g in grads):
        return False
    split = [d for d, pl in enumerate(placements) if mesh.size(d) > 1 and not isinstance(pl, Replicate)]
    if not split:
        return None
    if len(split) > 1 or not isinstance(placements[split[0]], Shard):
        return False
    return mesh.get_group(split[0])


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by their gradient's DeviceMesh (plain tensors: one group), in first-seen order."""
    groups: dict = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if is_dtensor(p.grad) else None, []).append(p)
    return list(groups.values()) or [[]]
