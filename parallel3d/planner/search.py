"""rank_layouts(): enumerate the layouts validation accepts, drop those that do not fit, rank the
rest by estimated step time, recommend one.

The rule of thumb (data parallelism / ZeRO while the model fits, tensor parallelism inside a
node, pipeline parallelism across nodes) is not hard-coded; it falls out of the cost model:
tensor-parallel traffic sits on the critical path every layer, so it only pays off over NVLink
and when sharding the model state is not enough; pipelining pays its bubble but sends little, so
it is what crosses slow links; FSDP's traffic hides behind compute until the links are too slow
for it. Among layouts within ``tolerance`` of the fastest, the simplest is recommended (fewest
parallel dimensions, lowest ZeRO stage, least recomputation). Tensor parallelism across nodes is
not enumerated unless asked for (``allow_cross_node_tp``): it never wins, and it doubles the search.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from omegaconf import DictConfig, OmegaConf

from parallel3d.base import ConfigError, divisors
from parallel3d.config.schema import Config
from parallel3d.planner.layout import Layout, ModelShape
from parallel3d.planner.plan import Hardware, Plan, make_plan
from parallel3d.validate import check

AC_ORDER = ("none", "op", "selective", "full")  # least recomputation first


@dataclass
class Candidate:
    plan: Plan
    overrides: list[str]  # what selects this layout on the command line
    recommended: bool = False
    rejected: list[str] = field(default_factory=list)  # checkpointing modes that did not fit

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def step_s(self) -> float:
        return self.plan.step_time.total_s

    def simplicity(self) -> tuple:
        lay = self.layout
        return (lay.pp > 1, lay.tp > 1, lay.cp > 1, lay.dp_replicate > 1, lay.zero_stage,
                AC_ORDER.index(lay.activation_checkpoint), lay.pp, lay.tp, lay.cp, self.plan.peak_bytes)


def overrides_of(layout: Layout) -> list[str]:
    out = [f"parallel.dp_replicate={layout.dp_replicate}", f"parallel.dp_shard={layout.dp_shard}",
           f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.zero_stage={layout.zero_stage}",
           f"train.micro_batch_size={layout.micro_batch_size}",
           f"model.activation_checkpoint={layout.activation_checkpoint}"]
    if layout.pp > 1:
        out.append(f"parallel.pp_schedule={layout.pp_schedule}")
    if layout.cp > 1:
        out += [f"parallel.cp={layout.cp}", f"parallel.cp_method={layout.cp_method}"]
    return out


@dataclass(frozen=True)
class SearchSpace:
    """What :func:`rank_layouts` tries besides the degrees (every divisor of the world size)."""

    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B")  # pipeline schedules, where pp > 1
    ac_modes: tuple[str, ...] = ("none", "op", "full")  # the cheapest that fits is kept
    cp_degrees: tuple[int, ...] = (1,)  # context-parallel degrees (long sequences)
    cp_methods: tuple[str, ...] = ("alltoall", "ring")
    allow_cross_node_tp: bool = False  # never wins, and doubles the search


def rank_layouts(cfg: Config | DictConfig, world_size: int, *, hardware: Hardware = Hardware(),
                 space: SearchSpace = SearchSpace(), tolerance: float = 0.03,
                 include_unfit: bool = False) -> list[Candidate]:
    """Every valid layout of ``cfg`` (a composed config: its model, ``train.seq_len``,
    ``global_batch_size``, ``param_dtype``, ``reduce_dtype`` and every other setting the
    candidates share) on ``world_size`` GPUs of ``hardware``, fastest first; the recommended one
    (the simplest within ``tolerance`` of the fastest) has ``recommended=True``.

    Each layout gets the cheapest checkpointing mode of ``space.ac_modes`` that fits; layouts that
    fit with none are dropped (kept at the end, with ``include_unfit``).
    """
    base = _base_config(cfg)
    model = ModelShape.from_config(base.model)
    fitting, unfit = [], []
    for layout in (lay for cp in space.cp_degrees if world_size % cp == 0
                   for method in (space.cp_methods if cp > 1 else ("alltoall",))
                   for lay in _layouts(_with_cp(base, cp, method), model, world_size // cp, hardware, space, cp)):
        tried = []
        for mode in sorted(space.ac_modes, key=AC_ORDER.index):
            plan = make_plan(model, replace(layout, activation_checkpoint=mode), hardware)
            if plan.fits:
                fitting.append(Candidate(plan, overrides_of(plan.layout), rejected=tried))
                break
            tried.append(mode)
        else:
            unfit.append(Candidate(plan, overrides_of(plan.layout), rejected=tried))
    fitting.sort(key=lambda c: c.step_s)
    if fitting:
        near = [c for c in fitting if c.step_s <= fitting[0].step_s * (1 + tolerance)]
        min(near, key=Candidate.simplicity).recommended = True
    unfit.sort(key=lambda c: c.plan.peak_bytes)
    return fitting + (unfit if include_unfit else [])


def _base_config(cfg: Config | DictConfig) -> Config:
    """A plain (dataclass) copy of ``cfg`` to copy candidates from (validation is cheapest on
    those), set for GPUs, with the layout's own keys cleared."""
    cfg = copy.deepcopy(cfg)
    if OmegaConf.is_config(cfg):
        cfg.run_dir = "."  # Hydra's own run dir exists only inside a Hydra run
        cfg = OmegaConf.to_object(cfg)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, cfg.train.seq_len)
    cfg.train.device = "cuda"
    cfg.model.compile = False
    cfg.parallel.fsdp_sharding_strategy = None
    cfg.parallel.pp_microbatches = cfg.parallel.pp_stages_per_rank = cfg.parallel.pp_layers_per_stage = None
    cfg.checkpoint.resume, cfg.checkpoint.init_from = "none", None
    return cfg


def _with_cp(base, cp: int, method: str):
    cfg = copy.deepcopy(base)
    cfg.parallel.cp, cfg.parallel.cp_method = cp, method
    return cfg


def _layouts(base: Config, model: ModelShape, world: int, hw: Hardware, space: SearchSpace, cp: int = 1):
    """Layouts validation accepts (checkpointing left to the caller); ``world``: ranks per cp rank."""
    node = max(hw.gpus_per_node // cp, 1)  # tp inside a node, with its cp ranks where they fit
    for tp in divisors(world):
        if tp > node and not space.allow_cross_node_tp or (tp <= node and node % tp):
            continue
        for pp in divisors(world // tp):
            dp = world // tp // pp
            for zero in space.zero_stages:
                if dp * cp == 1 and zero != 0:
                    continue  # without data parallelism (or cp, sharded alike) every stage is the same
                # HSDP: shard within a node, replicate across nodes
                replicas = [1] + ([dp // s for s in divisors(dp) if 1 < s < dp and tp * s <= node]
                                  if zero >= 2 else [])
                for dp_replicate in replicas:
                    for schedule in (space.schedules if pp > 1 else ("1F1B",)):
                        for mbs in space.micro_batch_sizes:
                            cfg = _candidate_config(base, dp_replicate, dp // dp_replicate, tp, pp, zero, schedule, mbs)
                            try:
                                cfg = check(cfg, world * cp, device="cuda")
                            except ConfigError:
                                continue
                            yield Layout.from_config(cfg, "cuda")


def _candidate_config(base, dp_replicate, dp_shard, tp, pp, zero, schedule, mbs):
    cfg = copy.deepcopy(base)
    p = cfg.parallel
    p.dp_replicate, p.dp_shard, p.tp, p.pp, p.zero_stage, p.pp_schedule = dp_replicate, dp_shard, tp, pp, zero, schedule
    cfg.train.micro_batch_size = mbs
    return cfg
