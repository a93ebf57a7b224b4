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

from omegaconf import OmegaConf

from parallel3d.planner.layout import Layout, ModelShape
from parallel3d.planner.plan import GiB, Hardware, Plan, evaluate
from parallel3d.validate import ConfigError, check, divisors

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


def rank_layouts(model_cfg, world_size: int, *, gpu_memory_bytes: int = 80 * GiB, gpus_per_node: int = 8,
                 intra_node_bw: float = 450e9, inter_node_bw: float = 50e9, peak_flops: float = 989e12,
                 efficiency: float = 0.5, seq_len: int = 8192, global_batch_size: int = 1024,
                 param_dtype: str = "bfloat16", reduce_dtype: str = "float32",
                 micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8), zero_stages: tuple[int, ...] = (0, 1, 2, 3),
                 schedules: tuple[str, ...] = ("1F1B", "Interleaved1F1B"),
                 ac_modes: tuple[str, ...] = ("none", "op", "full"), base_cfg=None,
                 allow_cross_node_tp: bool = False, tolerance: float = 0.03,
                 include_unfit: bool = False, cp_degrees: tuple[int, ...] = (1,),
                 cp_methods: tuple[str, ...] = ("alltoall", "ring")) -> list[Candidate]:
    """Every valid layout of ``model_cfg`` (a ModelConfig, or a composed config's ``model``) on
    ``world_size`` GPUs, fastest first; the recommended one has ``recommended=True``.

    Each layout gets the cheapest checkpointing mode of ``ac_modes`` that fits; layouts that fit
    with none are dropped (kept at the end, with ``include_unfit``). ``base_cfg``: a composed
    config whose other settings (optimizer, fsdp_prefetch, ...) the candidates share.
    ``cp_degrees``/``cp_methods``: context-parallel degrees and methods to try (long sequences).
    """
    hw = Hardware(gpu_memory_bytes, gpus_per_node, intra_node_bw, inter_node_bw, peak_flops, efficiency)
    base = _base_config(base_cfg, model_cfg, seq_len, global_batch_size, param_dtype, reduce_dtype)
    model = ModelShape.from_config(base.model)
    fitting, unfit = [], []
    for layout in (lay for cp in cp_degrees if world_size % cp == 0
                   for method in (cp_methods if cp > 1 else ("alltoall",))
                   for lay in _layouts(_with_cp(base, cp, method), model, world_size // cp, hw, micro_batch_sizes,
                                       zero_stages, schedules, allow_cross_node_tp, cp)):
        tried = []
        for mode in sorted(ac_modes, key=AC_ORDER.index):
            plan = evaluate(model, replace(layout, activation_checkpoint=mode), hw)
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


def _base_config(base_cfg, model_cfg, seq_len, global_batch_size, param_dtype, reduce_dtype):
    """A plain (dataclass) config to copy candidates from: validation is cheapest on those."""
    from parallel3d.config import compose

    cfg = copy.deepcopy(base_cfg) if base_cfg is not None else compose([])
    if OmegaConf.is_config(cfg):
        cfg.run_dir = "."  # Hydra's own run dir exists only inside a Hydra run
        cfg = OmegaConf.to_object(cfg)
    if model_cfg is not None:
        cfg.model = copy.deepcopy(OmegaConf.to_object(model_cfg) if OmegaConf.is_config(model_cfg) else model_cfg)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq_len)
    cfg.train.seq_len, cfg.train.global_batch_size = seq_len, global_batch_size
    cfg.train.param_dtype, cfg.train.reduce_dtype, cfg.train.device = param_dtype, reduce_dtype, "cuda"
    cfg.model.compile = False
    cfg.parallel.fsdp_sharding_strategy = None
    cfg.parallel.pp_microbatches = cfg.parallel.pp_stages_per_rank = cfg.parallel.pp_layers_per_stage = None
    cfg.checkpoint.resume, cfg.checkpoint.init_from = "none", None
    return cfg


def _with_cp(base, cp: int, method: str):
    cfg = copy.deepcopy(base)
    cfg.parallel.cp, cfg.parallel.cp_method = cp, method
    return cfg


def _layouts(base, model: ModelShape, world: int, hw: Hardware, micro_batch_sizes, zero_stages, schedules,
             allow_cross_node_tp: bool, cp: int = 1):
    """Layouts validation accepts (checkpointing left to the caller); ``world``: ranks per cp rank."""
    node = max(hw.gpus_per_node // cp, 1)  # tp inside a node, with its cp ranks where they fit
    for tp in divisors(world):
        if tp > node and not allow_cross_node_tp or (tp <= node and node % tp):
            continue
        for pp in divisors(world // tp):
            dp = world // tp // pp
            for zero in zero_stages:
                if dp * cp == 1 and zero != 0:
                    continue  # without data parallelism (or cp, sharded alike) every stage is the same
                # HSDP: shard within a node, replicate across nodes
                replicas = [1] + ([dp // s for s in divisors(dp) if 1 < s < dp and tp * s <= node]
                                  if zero >= 2 else [])
                for dp_replicate in replicas:
                    for schedule in (schedules if pp > 1 else ("1F1B",)):
                        for mbs in micro_batch_sizes:
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
