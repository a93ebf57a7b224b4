from parallel3d.parallel.compose import parallelize

__all__ = ["parallelize"]
