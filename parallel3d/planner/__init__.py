"""The layout planner: per-rank memory, communication, pipeline bubble and step time of a layout,
before any process group exists; and a ranking of every layout of a model on a cluster.

    from parallel3d.config.compose import compose
    from parallel3d.planner import Hardware, predict, rank_layouts

    plan = predict(compose(["recipe=llama3_70b"]), 64, Hardware())   # one configured layout
    plan.param_bytes, plan.activation_bytes, plan.peak_bytes, plan.comm_bytes, plan.bubble_fraction
    ranked = rank_layouts(compose(["recipe=llama3_70b"]), 64, hardware=Hardware())  # every layout, fastest first
    best = next(c for c in ranked if c.recommended)

What is exact and what is a model:

* Model state (``param_bytes``, ``grad_bytes``, ``optim_state_bytes``, and ``Plan.rank_model_state``
  for any rank): exact, byte for byte, for this code; tests/harness/parity.py checks it against every
  parity run, tests/test_planner.py against fake-process-group ranks with uneven shards.
* Activations per microbatch (``RankMemory.activation_per_microbatch``): counted tensor by tensor
  (``planner/activations.py``); exact against CPU kernels in float32 and bfloat16 (FSDP's mixed
  precision, every layout's) for every checkpointing mode, with and without tensor/sequence
  parallelism, on every pipeline stage. On CUDA it counts the fused RMSNorm and cuDNN attention,
  eager kernels (compiled blocks keep less); BENCHMARKS.md compares it with one-GPU peaks.
* Activations in flight (``activation_bytes``): replays torch's own schedule order.
* ``peak_bytes``: model state + activations + FSDP's gathered parameters and unsharded gradients
  (under pipelining replayed in the schedule's order: a stage's gradients exist from its first
  backward to its last), the pipeline's receive buffers, and an estimate of what comes and goes
  (the loss's backward, the block in backward). Not exact: tests/test_dryrun.py bounds its error
  against the dry run's measured peak, and BENCHMARKS.md reports it for 8B, 70B and 405B layouts.
* ``comm_bytes``: ring-algorithm bytes per rank per optimizer step (``planner/comm.py`` states the
  convention); bubbles: textbook formulas, checked against torch's schedules.
* ``step_time``: FLOPs at a fixed efficiency of peak, plus the bubble and the communication that
  cannot overlap; a ranking device, not a benchmark.
"""

from parallel3d.planner.layout import Layout, ModelShape
from parallel3d.planner.memory import ModelState
from parallel3d.planner.plan import Hardware, Plan, RankMemory, StepTime, make_plan, predict
from parallel3d.planner.schedule import bubble_fraction
from parallel3d.planner.search import Candidate, SearchSpace, rank_layouts

__all__ = ["Candidate", "Hardware", "Layout", "ModelShape", "ModelState", "Plan", "RankMemory", "StepTime",
           "SearchSpace", "bubble_fraction", "make_plan", "predict", "rank_layouts"]
