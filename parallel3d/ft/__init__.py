"""Fault tolerance across replica groups (torchft): quorum, cross-group averaging, healing, membership."""

from parallel3d.base import RunError


class FTError(RunError):
    """A fault-tolerance failure every rank of a group meets alike (a refused group, a lost
    lighthouse): rank 0 says it for all, in one line."""

    every_rank = True
