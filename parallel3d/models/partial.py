"""A replicated DTensor used as a plain tensor by code that sees only this rank's share of the
work (its tokens under sequence parallelism, its heads under tensor parallelism)."""

from __future__ import annotations

import torch

from parallel3d.base import is_dtensor


def partial_local(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as this rank's plain tensor whose gradient is this rank's partial sum: where the
    DTensor is replicated over a mesh whose ranks compute on different tokens or heads, its
    gradient is marked ``Partial``, so it is summed over that mesh before use. A plain tensor is
    returned as it is."""
    if not is_dtensor(tensor):
        return tensor
    from torch.distributed.tensor import Partial, Replicate

    return tensor.to_local(grad_placements=[Partial() if isinstance(p, Replicate) else p for p in tensor.placements])
