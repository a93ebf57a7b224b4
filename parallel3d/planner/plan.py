"""predict(): memory, communication, bubble and step time of one layout."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from parallel3d.base import GIB
from parallel3d.models import flops_per_token
from parallel3d.planner.activations import (Geometry, block_bytes, checkpointed, receive_buffer_bytes,
                                            ring_scores_bytes, stage_activation_bytes)
from parallel3d.planner.comm import stage_traffic
from parallel3d.planner.layout import Layout, ModelShape, rank_stages
from parallel3d.planner.memory import ModelState, stage_model_state, transient_bytes, unsharded_gradient_bytes
from parallel3d.planner.schedule import bubble_fraction, in_flight_microbatches, peak_in_flight
from parallel3d.validate import check


@dataclass(frozen=True)
class Hardware:
    """What step-time estimates and the memory fit assume. Defaults: H100 SXM 80 GB nodes."""

    gpu_memory_bytes: int = 80 * GIB
    gpus_per_node: int = 8
    intra_node_bw: float = 450e9  # bytes/s one GPU sends inside a node (NVLink 4: 900 GB/s both ways)
    inter_node_bw: float = 50e9  # bytes/s one GPU sends across nodes (a 400 Gb/s NIC per GPU)
    peak_flops: float = 989e12  # dense bf16, parallel3d.observe.metrics.PEAK_FLOPS["H100"]
    efficiency: float = 0.5  # share of peak that large matmuls reach (the best MFU a layout can get)
    usable_memory: float = 0.9  # share of GPU memory to plan for: CUDA context, NCCL, fragmentation

    def bandwidth(self, span: int) -> float:
        """Per-GPU bandwidth of a group whose ranks lie within ``span`` consecutive ranks."""
        return self.intra_node_bw if span <= self.gpus_per_node else self.inter_node_bw


def group_spans(layout: Layout) -> dict[str, int]:
    """Consecutive ranks each group's members spread over; the mesh is (pp, dp_replicate,
    dp_shard, cp, tp), tp innermost, so tp groups are neighbours and pp groups span the world; ep
    groups are ep consecutive ranks of dp_shard x cp x tp (``mesh.build_mesh``)."""
    t, tc = layout.tp, layout.tp * layout.cp
    spans = {"tp": t, "cp": tc, "cp_tp": tc, "dp_shard": tc * layout.dp_shard, "dp_shard_cp": tc * layout.dp_shard,
             "dp": tc * layout.dp, "dp_cp": tc * layout.dp, "dp_replicate": tc * layout.dp, "pp": layout.world_size,
             "ep": layout.ep, "expert_dp": tc * layout.dp,
             "ft": layout.world_size * layout.ft_replicas}  # one rank of each replica group: other jobs, other nodes
    # Muon's holders of FSDP x tp pieces (``planner/comm.py``): the data-parallel group's ranks with their tp ranks
    return spans | {f"{group}_tp": spans[group] for group in ("dp", "dp_cp", "dp_shard", "dp_shard_cp")}


@dataclass
class StepTime:
    compute_s: float  # model FLOPs plus recomputation, at hardware.efficiency x peak
    bubble_s: float  # pipeline idle time
    comm_s: dict[str, float]  # time each group's traffic takes, overlapped or not
    exposed_comm_s: float  # what overlapping with compute leaves on the critical path
    total_s: float
    mfu: float  # model FLOPs (no recomputation) / (ranks x peak x step time)
    tokens_per_s: float


@dataclass
class RankMemory:
    """One pipeline rank's memory, on its data-parallel rank 0 (FSDP/ZeRO-1 give it the most)."""

    pp_rank: int
    stages: tuple[int, ...]
    param_bytes: int
    grad_bytes: int
    optim_state_bytes: int
    activation_bytes: int  # peak of stored activations over the schedule step
    transient_bytes: int  # FSDP buffers, loss gradients, the block in backward (estimate)
    activation_per_microbatch: dict[int, int] = field(default_factory=dict)  # stage -> bytes one microbatch keeps
    receive_buffer_bytes: int = 0  # the pipeline's per-microbatch receive buffers (activations and gradients)
    # False when gradients accumulate unsharded through the whole step (pipelining over one schedule
    # step, ZeRO-1 over several micro batches): the sharded ones appear after the peak, at the end.
    grads_at_peak: bool = True
    # Under pipelining with FSDP: the peak of the activations together with each stage's gradients,
    # replayed in the schedule's order (planner.schedule.peak_in_flight).
    in_flight_bytes: int | None = None

    @property
    def peak_bytes(self) -> int:
        in_flight = self.activation_bytes if self.in_flight_bytes is None else self.in_flight_bytes
        return (self.param_bytes + self.grad_bytes * self.grads_at_peak + self.optim_state_bytes
                + in_flight + self.transient_bytes + self.receive_buffer_bytes)


@dataclass
class Plan:
    """What one layout costs per rank. Memory fields are the largest over ranks (as metrics.jsonl
    logs them); ``param_bytes``, ``grad_bytes``, ``optim_state_bytes`` are exact for this code,
    the rest are models (see the planner package docstring)."""

    model: ModelShape
    layout: Layout
    param_bytes: int
    grad_bytes: int
    optim_state_bytes: int
    activation_bytes: int
    peak_bytes: int
    ranks: list[RankMemory]
    comm_bytes: dict[str, dict[str, float]]  # group -> collective -> bytes sent per rank per step
    bubble_fraction: float
    model_flops_per_step: float
    step_time: Optional[StepTime] = None
    fits: Optional[bool] = None  # peak within hardware.usable_memory x gpu_memory_bytes

    @property
    def model_state_bytes(self) -> dict[str, int]:
        return {"param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
                "optim_state_bytes": self.optim_state_bytes}

    def rank_model_state(self, rank: int) -> ModelState:
        """Exact model state of global ``rank`` (mesh order pp, dp_replicate, dp_shard, cp, tp)."""
        lay = self.layout
        pp_rank, dp_rank = rank // (lay.dp * lay.cp * lay.tp), rank // lay.tp % (lay.dp * lay.cp)
        stages = rank_stages(lay, self.model.n_layers, pp_rank)
        return sum((stage_model_state(self.model, s, lay, dp_rank) for s in stages), ModelState())

    def to_dict(self) -> dict:
        out = asdict(self)
        for rank, memory in zip(out["ranks"], self.ranks):
            rank["peak_bytes"] = memory.peak_bytes
        out["name"] = self.layout.name()
        return out


def predict(cfg, world_size: int, hardware: Hardware | None = None) -> Plan:
    """Predict one configured layout: ``cfg`` is a composed config (DictConfig or the dataclass
    ``Config``), validated and resolved (dp_shard=-1 ...) by ``validate.check``, which leaves
    ``cfg`` as it is."""
    machines = "cpu" if cfg.train.device == "cpu" else "cuda"  # a plan may be made away from the cluster
    cfg = check(cfg, world_size, device=machines)
    return make_plan(ModelShape.from_config(cfg.model), Layout.from_config(cfg, machines), hardware)


def make_plan(model: ModelShape, layout: Layout, hardware: Hardware | None = None) -> Plan:
    """The plan of a layout that validation accepted."""
    ranks, traffic = [], {}
    for pp_rank in range(layout.pp):
        stages = rank_stages(layout, model.n_layers, pp_rank)
        state = sum((stage_model_state(model, s, layout) for s in stages), ModelState())
        per_microbatch = {s.index: stage_activation_bytes(model, s, layout) for s in stages}
        activations = peak_in_flight(layout, per_microbatch, pp_rank)
        grads_at_peak = not _reduced_once_per_step(layout)
        unsharded = {s.index: unsharded_gradient_bytes(model, s, layout) for s in stages}
        sharded = {s.index: 0 if grads_at_peak else stage_model_state(model, s, layout).grad_bytes for s in stages}
        in_flight = (peak_in_flight(layout, per_microbatch, pp_rank, unsharded, sharded)
                     if any(unsharded.values()) else None)
        layers = [layer for s in stages for layer in s.blocks]
        transient = transient_bytes(model, stages, layout, _backward_block_bytes(model, layout, layers))
        buffers = receive_buffer_bytes(model, stages, layout, in_flight_microbatches(layout, pp_rank))
        ranks.append(RankMemory(pp_rank, tuple(s.index for s in stages), state.param_bytes, state.grad_bytes,
                                state.optim_state_bytes, activations, transient, per_microbatch, buffers,
                                grads_at_peak=grads_at_peak, in_flight_bytes=in_flight))
        rank_traffic = stage_traffic(model, stages, layout)
        if _total(rank_traffic) > _total(traffic):
            traffic = rank_traffic
    bubble = bubble_fraction(layout.pp_schedule, layout.pp, layout.schedule_microbatches, layout.stages_per_rank)
    tokens = layout.global_batch_size * layout.seq_len
    plan = Plan(
        model=model, layout=layout,
        param_bytes=max(r.param_bytes for r in ranks), grad_bytes=max(r.grad_bytes for r in ranks),
        optim_state_bytes=max(r.optim_state_bytes for r in ranks),
        activation_bytes=max(r.activation_bytes for r in ranks), peak_bytes=max(r.peak_bytes for r in ranks),
        ranks=ranks, comm_bytes=traffic, bubble_fraction=bubble,
        model_flops_per_step=flops_per_token(model, layout.seq_len) * tokens,
    )
    if hardware is not None:
        plan.step_time = step_time(model, layout, plan, hardware)
        plan.fits = plan.peak_bytes <= hardware.usable_memory * hardware.gpu_memory_bytes
    return plan


def _reduced_once_per_step(layout: Layout) -> bool:
    """Sharded gradients reduced once, at the step's very end, from unsharded accumulations."""
    if layout.shards == 1:
        return False
    if layout.pp > 1:
        return layout.schedule_steps == 1
    return layout.zero_stage == 1 and layout.micro_batches > 1


def _backward_block_bytes(model: ModelShape, layout: Layout, layers: list[int]) -> int:
    """Memory a block's backward needs beyond what is stored: a checkpointed block rematerializes
    what it did not keep, and gradients of its activations are about one more activation set."""
    g = Geometry.of(layout)
    blocks = {(checkpointed(layer, layout), model.is_moe(layer)) for layer in layers}
    # The largest of the rank's blocks (dense or MoE: DeepSeek-V3's first stage has dense ones
    # only) in backward, as the estimate's worst case.
    need = max((2 * block_bytes(model, g, "none", moe) - block_bytes(model, g, mode, moe) for mode, moe in blocks),
               default=0)
    return need + ring_scores_bytes(model, layout)


def _total(traffic: dict[str, dict[str, float]]) -> float:
    return sum(v for kinds in traffic.values() for v in kinds.values())


def step_time(model: ModelShape, layout: Layout, plan: Plan, hw: Hardware) -> StepTime:
    """Compute at ``hw.efficiency`` of peak, stretched by the bubble, plus the communication that
    cannot hide behind compute: tensor- and pipeline-parallel traffic is on the critical path;
    FSDP's per-micro-batch gathers and reductions overlap with compute (prefetch), while gradient
    reductions at the end of a step (DDP, ZeRO-1, any reduction under pipelining) overlap with at
    most the last micro batch's backward, and ZeRO-1's parameter all-gather and Muon's exchange
    with nothing."""
    world = layout.world_size
    recomputed = sum(1 for layer in range(model.n_layers) if checkpointed(layer, layout) == "full")
    per_token = flops_per_token(model, layout.seq_len)
    block_flops = (per_token - 6 * model.vocab_size * model.dim) / model.n_layers  # training FLOPs of one block
    tokens = layout.global_batch_size * layout.seq_len
    flops = plan.model_flops_per_step + recomputed * block_flops / 3 * tokens  # a recompute: one more forward
    compute = flops / world / (hw.peak_flops * hw.efficiency)
    bubble = compute * plan.bubble_fraction / (1 - plan.bubble_fraction)
    spans = group_spans(layout)
    times = {group: {kind: sent / hw.bandwidth(spans[group]) for kind, sent in kinds.items()}
             for group, kinds in plan.comm_bytes.items()}
    last_backward = compute / layout.micro_batches * 2 / 3
    overlapped, end_of_step, exposed = 0.0, 0.0, 0.0
    for group, kinds in times.items():
        for kind, seconds in kinds.items():
            if group in ("tp", "pp", "cp", "cp_tp") or (group in ("dp", "dp_cp") and kind == "all_gather") \
                    or (kind == "all_to_all" and group != "ep"):
                # cp: attention waits for its all-to-alls / each ring hop; Muon's exchange (an
                # all-to-all in a data-parallel group) runs between backward and the update
                exposed += seconds
            elif group in ("dp_shard", "dp_shard_cp", "dp_replicate") and (layout.pp == 1 or kind == "all_gather"):
                overlapped += seconds
            else:
                end_of_step += seconds
    window = 0.0 if layout.pp > 1 else last_backward
    exposed += max(0.0, overlapped - compute) + max(0.0, end_of_step - window)
    total = compute + bubble + exposed
    return StepTime(compute_s=compute, bubble_s=bubble, comm_s={g: sum(k.values()) for g, k in times.items()},
                    exposed_comm_s=exposed, total_s=total,
                    mfu=plan.model_flops_per_step / (world * hw.peak_flops * total), tokens_per_s=tokens / total)
