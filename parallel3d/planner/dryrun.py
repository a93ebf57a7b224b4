"""Dry run: the real program for chosen ranks of a large layout, on one CPU, with no real memory.

For each rank: compose the config and ``validate.check`` it (a ConfigError comes before anything
is built), start torch's *fake* process group as that rank (collectives return at once, moving
nothing), build the mesh, model, optimizer and scheduler with ``step.build_setup`` as training
does, materializing them inside ``FakeTensorMode`` (tensors with shapes, dtypes and storages but no
data), create the optimizer's state (as a step after the first finds it), then run one
``step.train_step``: forward and backward through the pipeline schedule under pp, clipping,
optimizer and lr steps. Meanwhile a MemTracker follows
every tensor storage (peak and what it held at the peak) and a dispatch mode records every
collective with its process group and size.

Pipelining on the fake process group: the schedule's start-up exchanges values (a vote on static
or dynamic shape inference, then shapes), and a fake group returns none. So the dry run gives each
stage its input/output metadata (tokens, or hidden states of micro_batch x seq (/tp under sequence
parallelism) x dim, in the compute dtype), answers the vote "static" as every stage then would,
and turns on torch's runtime check of each stage's tensors against that metadata: a wrong guess
fails loudly. Everything else, the send/recv of every micro batch included, runs as in training.

Memory: ``peak_bytes`` is all tensor memory at the step's peak (a GPU adds its CUDA context, NCCL
buffers and allocator fragmentation); ``peak_breakdown`` splits it by MemTracker's categories:
Parameter (with FSDP's gathered copies while they exist), Gradient (as autograd accumulates
them), Optstate, Activation (made in forward: saved tensors, all-gather and receive buffers), Temp
(made in backward), Buffer (RoPE tables), Other (the batch).

Not run: data loading, checkpoints, logging (whose all-reduces every log step are scalars: the
loss over pp and dp, 4 bytes each, and per-rank memory over the world, 32 bytes).

Communication convention (per rank, per optimizer step): ``bytes`` is the payload of a call:
all-gather its output, reduce-scatter its input, all-reduce/broadcast/send/recv the tensor,
all-to-all its input. ``sent_bytes`` is what this rank puts on the wire under ring algorithms:
(n-1)/n of the payload for all-gather, reduce-scatter, broadcast and all-to-all, 2(n-1)/n for
all-reduce, all of it for send, nothing for recv (n: the group's size).
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas
from torch.distributed.tensor import DTensor, _sharding_prop
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel3d.base import DTYPES
from parallel3d.config.compose import compose
from parallel3d.config.schema import Config
from parallel3d.observe.metrics import model_state_bytes
from parallel3d.optim.adamw import init_optimizer_state
from parallel3d.parallel.mesh import Meshes, ParallelDims
from parallel3d.planner.comm import GROUPS
from parallel3d.step import build_setup, train_step
from parallel3d.validate import check

COMM_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")
NOT_COMMUNICATION = ("wait_tensor", "barrier", "monitored_barrier_", "_wrap_tensor_autograd")
# Op-name fragment -> kind, most specific first ("_reduce_scatter_base_" is no all-reduce).
KINDS = (("reduce_scatter", "reduce_scatter"), ("allgather", "all_gather"), ("all_gather", "all_gather"),
         ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("broadcast", "broadcast"),
         ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"), ("send", "send"), ("recv", "recv"))
RING_FACTOR = {"all_reduce": 2.0, "send": None, "recv": 0.0}  # x (n-1)/n; None: the whole payload
# Ops whose result the host must wait for (a GPU stalls its queue for each): .item(), bool(t),
# torch.equal, data-dependent output sizes.
HOST_READS = {"_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select", "unique", "_unique2"}


@dataclass
class CommStat:
    group_size: int = 1  # n, ranks in the process group
    calls: int = 0
    bytes: int = 0  # payload, see the module docstring
    sent_bytes: float = 0.0  # on the wire from this rank, ring algorithms


@dataclass
class RankReport:
    rank: int
    coords: dict[str, int]  # this rank's index along each mesh dimension
    stages: list[int]  # the pipeline stages it runs
    param_bytes: int  # local shards, as metrics.model_state_bytes counts them
    grad_bytes: int
    optim_state_bytes: int
    peak_bytes: int  # all tensor memory at the step's peak
    peak_breakdown: dict[str, int]  # what it held at that moment, by MemTracker's categories
    comm: dict[str, dict[str, CommStat]] = field(default_factory=dict)  # mesh dim -> kind -> totals
    host_reads: list[str] = field(default_factory=list)  # ops in the step that wait for device values
    seconds: float = 0.0


class CommRecorder(TorchDispatchMode):
    """Records the collectives that reach the dispatcher (FSDP's c10d calls, DTensor's functional
    collectives, pipeline send/recv) and every host read (``HOST_READS``). Observation only: every
    op runs as it would (on fake tensors a host read fails: it has no value to read)."""

    def __init__(self, dim_of_group: dict[str, str]):
        super().__init__()
        self.dim_of_group = dim_of_group
        self.stats: dict[str, dict[str, CommStat]] = defaultdict(lambda: defaultdict(CommStat))
        self.host_reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower itself to local ops and collectives first
        name = func._schema.name.split("::")[-1]
        if func.namespace == "aten" and name in HOST_READS:
            self.host_reads.append(name)
        out = func(*args, **(kwargs or {}))
        if func.namespace in COMM_NAMESPACES and name not in NOT_COMMUNICATION:
            self._record(func.namespace, name, args, out)
        return out

    def _dim(self, group: dist.ProcessGroup) -> str:
        """The mesh dim(s) ``group`` spans: a mesh's own group, or one made later for mesh dims
        together (Muon's holders of FSDP x tp pieces) and described by their planner name."""
        if group.group_name in self.dim_of_group:
            return self.dim_of_group[group.group_name]
        return group.group_desc if group.group_desc in GROUPS else f"group {group.group_name}"

    def _record(self, namespace: str, name: str, args, out) -> None:
        kind = next((k for fragment, k in KINDS if fragment in name), name)
        if namespace == "c10d":  # (outputs, inputs, group, ...) or (tensors, group, reduce op, ...)
            group = dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject)))
            payload = args[1] if kind in ("reduce_scatter", "all_to_all") else args[0]
        else:  # functional: (input, ..., group_name) -> output
            group = _resolve_process_group([a for a in args if isinstance(a, str)][-1])
            payload = out if kind == "all_gather" else args[0]
        nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(payload) if isinstance(t, torch.Tensor))
        n = group.size()
        factor = RING_FACTOR.get(kind, 1.0)
        stat = self.stats[self._dim(group)][kind]
        stat.group_size = n
        stat.calls += 1
        stat.bytes += nbytes
        stat.sent_bytes += nbytes if factor is None else factor * nbytes * (n - 1) / n


class ForwardHookModTracker(ModTracker):
    """The module tracking MemTracker needs, without ModTracker's backward hooks: those are
    multi-grad hooks on each module's inputs, and on a pipeline stage's leaf input they break
    torch.autograd.grad, which the zero-bubble schedules call to split backward. MemTracker's
    backward state comes from the autograd engine (``is_bw``), not from these hooks."""

    def _fw_pre_hook(self, mod, input) -> None:
        self._get_mod_name(mod)  # registers the names MemTracker looks up
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)

    def _fw_post_hook(self, mod, input, output) -> None:
        if self._user_post_fw_hook is not None:
            self._user_post_fw_hook(mod, input, output)


class StepMemTracker(MemTracker):
    """MemTracker for one step of several micro batches, keeping only what the dry run reports:
    totals by category and their peak, updated op by op. (MemTracker takes a root module's second
    forward for a second iteration and refuses it, to protect per-module snapshots not used here.)"""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = ForwardHookModTracker()

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        # After every op. MemTracker also updates each active module's own peak, looping over all
        # modules (half the dry run's time on a 405B stage); only the global peak is kept here.
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


def representative_ranks(parallel, world_size: int) -> list[int]:
    """The first rank of each pipeline stage (pp is the outermost mesh dim): stages hold different
    layers, while ranks within a stage differ only by the odd uneven shard."""
    return list(range(0, world_size, world_size // parallel.pp))


def dry_run(overrides: list[str], world_size: int, ranks: list[int] | None = None,
            announce=lambda line: None) -> list[RankReport]:
    """Run one training step of ``ranks`` (default: one per pipeline stage) of the configured layout
    on ``world_size`` fake ranks; see the module docstring. Raises ConfigError before building.
    ``announce`` gets a line before each rank (a large layout takes minutes per rank)."""
    if not any(o.startswith("run_dir=") for o in overrides):  # never written: the checks only read it
        overrides = [*overrides, f"run_dir={tempfile.gettempdir()}/parallel3d-dryrun"]
    cfg = compose(overrides)
    # The layout is meant for the cluster: check it against that cluster's device, not this CPU's.
    cfg = check(cfg, world_size, device="cpu" if cfg.train.device == "cpu" else "cuda")
    c: Config = OmegaConf.to_object(cfg)
    ranks = representative_ranks(c.parallel, world_size) if ranks is None else ranks
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"ranks {bad} are outside 0..{world_size - 1}")
    reports = []
    for n, r in enumerate(ranks):
        announce(f"dry run: rank {r} ({n + 1} of {len(ranks)})")
        reports.append(run_rank(c, world_size, r))
    return reports


class CountedReplicas:
    """ft.enabled: the step's cross-group all-reduces without other groups (step.ReplicaSync): what
    parallel3d/ft/replica.py would send, counted under ``ft`` from the step's real gradients."""

    def __init__(self, kinds: dict[str, CommStat], replicas: int, every: int = 1):
        self.kinds, self.replicas, self.every = kinds, replicas, every  # every: DiLoCo's inner steps
        self.params: list[torch.Tensor] = []

    def _count(self, tensors: list[torch.Tensor], share: float = 1.0) -> None:
        stat = self.kinds["all_reduce"]
        stat.group_size, stat.calls = self.replicas, stat.calls + 1
        payload = sum(t.numel() * t.element_size() for t in tensors) * share
        stat.bytes += payload
        stat.sent_bytes += 2.0 * payload * (self.replicas - 1) / self.replicas

    def average_gradients(self, params: list[torch.Tensor], loss_sum: torch.Tensor) -> None:
        self.params = params
        if self.every == 1:
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
            self._count(grads + [loss_sum])

    def average(self, tensor: torch.Tensor) -> None:
        if self.every == 1:
            self._count([tensor])

    def commit(self) -> bool:
        return True

    def after_update(self) -> None:
        """DiLoCo: the pseudo-gradient (a float32 copy of each local parameter shard), per step its share."""
        if self.every > 1:
            local = [p.to_local() if isinstance(p, DTensor) else p for p in self.params]
            self._count([torch.empty(t.shape, dtype=torch.float32, device="meta") for t in local], 1 / self.every)


def run_rank(c: Config, world_size: int, rank: int, fake: bool = True) -> RankReport:
    """One rank's dry run (on the fake process group, started and destroyed here). ``fake=False``
    runs it on real tensors instead (a small model's check of what fake tensors report)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    start = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        device, t = torch.device("cpu"), c.train
        tensors = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
        setup = build_setup(c, device, materialize=tensors)  # as train() builds it
        model, pipeline, tied, meshes = setup.model, setup.pipeline, setup.tied, setup.meshes
        if pipeline is not None:
            _static_stage_metadata(pipeline, c, setup.dims)
        recorder = CommRecorder(_dim_of_group(meshes, tied))
        with tensors:
            init_optimizer_state(setup.optimizer)  # AdamW creates it in its first step: measure a later one
            micro_batches = [(torch.randint(0, c.model.vocab_size, (t.micro_batch_size, t.seq_len)),
                              torch.randint(0, c.model.vocab_size, (t.micro_batch_size, t.seq_len)))
                             for _ in range(setup.spec.num_micro_batches)]
            tracker = StepMemTracker()
            tracker.track_external(model, setup.optimizer, micro_batches)
            every = c.ft.diloco.inner_steps if c.ft.semi_sync == "diloco" else 1
            replicas = CountedReplicas(recorder.stats["ft"], c.ft.replicas, every) if c.ft.enabled else None
            with tracker, recorder, _own_fake_mode_for_sharding_propagation():
                train_step(setup, micro_batches, replicas=replicas)
            state = model_state_bytes(model, setup.optimizer)  # as train() measures it: after the step, grads kept
        peak = tracker.get_tracker_snapshot("peak").get(device, {})
        coords = {name: meshes.world.get_local_rank(name) for name in meshes.world.mesh_dim_names} \
            if meshes.world is not None else {}
        return RankReport(
            rank=rank, coords=coords, stages=[s.stage_index for s in pipeline.stages] if pipeline else [0],
            **state, peak_bytes=peak.get("Total", 0),
            peak_breakdown={str(getattr(k, "value", k)): v for k, v in peak.items() if k != "Total"},
            comm={dim: dict(kinds) for dim, kinds in recorder.stats.items()}, host_reads=recorder.host_reads,
            seconds=time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
        # DTensor caches sharding decisions by mesh *layout*; the next rank's meshes have the same
        # layouts but new process groups, so cached results would name this rank's dead groups.
        _clear_sharding_prop_cache()
        clear_redistribute_planner_cache()
        gc.collect()


def _own_fake_mode_for_sharding_propagation():
    """DTensor infers each op's global output shape by running it on global-shape fake tensors, in
    the active fake mode if there is one: the dry run's, whose every tensor MemTracker counts (a
    whole unsharded weight or the full vocabulary's logits, briefly). Give it a fake mode of its own,
    as in a real run, so that MemTracker, which ignores other fake modes, counts local tensors only."""
    return mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args, **kwargs: None)


def _dim_of_group(meshes: Meshes, tied) -> dict[str, str]:
    """Process-group name -> the mesh dimension(s) it spans."""
    names = {dist.group.WORLD.group_name: "world"}
    if meshes.world is not None:
        for dim in meshes.world.mesh_dim_names:
            names[meshes.world.get_group(dim).group_name] = dim
    if meshes.dp is not None and meshes.dp.mesh_dim_names == ("dp",):  # dp_replicate x dp_shard, flattened
        names[meshes.dp.get_group().group_name] = "dp"
    for mesh in (meshes.dp_cp, meshes.fsdp):  # with cp: data-parallel (shard) ranks x cp, flattened
        for dim in (mesh.mesh_dim_names if mesh is not None else ()):
            if dim in ("dp_cp", "dp_shard_cp"):
                names[mesh.get_group(dim).group_name] = dim
    if meshes.cp_tp is not None and meshes.cp_tp.mesh_dim_names == ("cp_tp",):  # cp x tp, flattened (MoE counts)
        names[meshes.cp_tp.get_group().group_name] = "cp_tp"
    for name in ("ep", "expert_dp"):  # expert parallelism's views of the dp x cp x tp ranks
        if getattr(meshes, name) is not None:
            names[getattr(meshes, name).get_group().group_name] = name
    if tied is not None and tied.group is not None:  # first and last pp stage of one (dp, tp) coordinate
        names[tied.group.group_name] = "pp_ends"
    return names


def _static_stage_metadata(pipeline, c: Config, dims: ParallelDims) -> None:
    """Give each stage the shapes its neighbours would have sent at start-up (see module docstring)."""
    t = c.train
    local = t.seq_len // dims.cp  # a cp rank's part of each sequence
    seq = local // dims.tp if dims.tp > 1 and c.parallel.sequence_parallel else local
    dtype = DTYPES[t.param_dtype]  # FSDP's cast: the whole model computes in it (parallel/data.py)
    with torch.device("meta"):
        hidden = torch.empty(t.micro_batch_size, seq, c.model.dim, dtype=dtype, requires_grad=True)
        tokens = torch.empty(t.micro_batch_size, local, dtype=torch.long)
        logits = torch.empty(t.micro_batch_size, local, c.model.vocab_size // dims.tp)  # counted only
    for stage in pipeline.stages:
        stage._user_meta = _StageMeta(inputs=extract_tensor_metas((tokens,) if stage.is_first else (hidden,)),
                                      outputs=extract_tensor_metas((logits,) if stage.is_last else (hidden,)))
        stage._runtime_validate = True  # every micro batch's tensors are checked against the metadata

    def vote_static(stages, has_backward, p2p_done) -> None:  # what the vote returns once all have metadata
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    pipeline.schedule._warmup_p2p = vote_static
