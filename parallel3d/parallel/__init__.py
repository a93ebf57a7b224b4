from parallel3d.parallel.compose import ActivationPlan, ParallelPlan, parallelize

__all__ = ["ActivationPlan", "ParallelPlan", "parallelize"]
