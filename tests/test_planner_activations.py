"""The planner's activation memory (parallel3d/planner/activations.py) against what autograd keeps
on CPU: every checkpointing mode, float32 and bfloat16, dense and mixture-of-experts blocks, on
ranks built on torch's fake process group in forks of this process (tests/test_planner.py); expert
parallelism on two real gloo ranks, whose all-to-all routing a fake group cannot carry."""

from __future__ import annotations

import contextlib
import copy
import gc
import multiprocessing
import os
import socket
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_planner import _build, _config, in_fork
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel3d.config.compose import compose
from parallel3d.data.documents import document_inputs
from parallel3d.parallel.activation import apply_activation_checkpointing
from parallel3d.parallel.expert import AllToAllDispatch, apply_expert_parallel
from parallel3d.parallel.mesh import ParallelDims, build_mesh
from parallel3d.parallel.tensor import apply_tensor_parallel
from parallel3d.planner import predict


class LiveStorages(TorchDispatchMode):
    """Records every storage an op creates; ``alive()`` sums those still referenced (by autograd's
    saved tensors, checkpoint caches, or the caller), each once."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, weakref.ref] = {}
        self.created: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            t = t._local_tensor if isinstance(t, DTensor) else t
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                known = self.refs.get(id(storage))
                if known is None or known() is not storage:  # ids of dead storages get reused
                    self.refs[id(storage)] = ref = weakref.ref(storage)
                    self.created.append(ref)
        return out

    def alive(self, exclude: set[int]) -> int:
        # Storages that only unreachable reference cycles still hold (autograd graphs of earlier
        # forwards, awaiting Python's cyclic collector, which runs at no fixed point) are not
        # activations: collect them first, or the count depends on when the collector last ran.
        gc.collect()
        seen, total = set(exclude), 0
        for ref in self.created:
            storage = ref()
            if storage is None:
                continue
            try:
                ptr = storage.data_ptr()
            except RuntimeError:  # fake process group outputs without data
                continue
            if ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
        return total


MODES = ("none", "full", "selective", "op")
DTYPES = (torch.float32, torch.bfloat16)


def measured_activations(c, world: int, pp_rank: int) -> dict[tuple[str, torch.dtype], int]:
    """Bytes one microbatch leaves alive after the forward of ``pp_rank``'s stage (its tp rank 0),
    for every checkpointing mode and compute dtype."""
    if world > 1:
        dist.init_process_group("fake", rank=pp_rank * world // c.parallel.pp, world_size=world, store=FakeStore())
    try:
        meshes = build_mesh(ParallelDims.from_config(c.parallel), "cpu", ep=c.parallel.ep)
        return {(mode, dtype): _stage_activations(c, meshes, pp_rank, mode, dtype)
                for mode in MODES for dtype in DTYPES}
    finally:
        if world > 1:
            dist.destroy_process_group()


def _stage_activations(c, meshes, pp_rank: int, mode: str, dtype: torch.dtype) -> int:
    (part,) = _build(c, meshes, pp_rank)
    if meshes.tp is not None:
        apply_tensor_parallel(part, meshes.tp, c.parallel.sequence_parallel)
    if meshes.ep is not None:
        apply_expert_parallel(part, meshes.ep, c.parallel.tp)
    apply_activation_checkpointing(part, mode, c.model.activation_checkpoint_every)
    part.to_empty(device="cpu")
    part.init_weights(0)
    # As step.train_step computes: in every layout FSDP's mixed-precision policy casts the
    # parameters, and the whole model, its residual stream included, computes in ``dtype``.
    part.to(dtype)
    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    exclude = {local(t).untyped_storage().data_ptr() for t in [*part.parameters(), *part.buffers()]}
    b, s = c.train.micro_batch_size, c.train.seq_len
    if part.embeds_input:
        x = torch.randint(0, 256, (b, s))
        exclude.add(x.untyped_storage().data_ptr())
    targets = torch.randint(0, 256, (b * s,))
    exclude.add(targets.untyped_storage().data_ptr())
    documents = document_inputs(torch.randint(0, 257, (b, s)), c.data)  # inputs, like the tokens
    exclude |= {t.untyped_storage().data_ptr() for t in documents.values()}
    tracker = LiveStorages()
    with (loss_parallel() if meshes.tp is not None else contextlib.nullcontext()), tracker:
        if not part.embeds_input:  # received activations: the pipeline stage keeps them, so they count
            rows = s // c.parallel.tp if c.parallel.tp > 1 and c.parallel.sequence_parallel else s
            x = torch.randn(b, rows, c.model.dim, dtype=dtype, requires_grad=True)
        out = part(x, **documents)
        if part.norm is not None:  # the last stage: the loss, as train.py computes it
            loss = F.cross_entropy(out.flatten(0, 1).float(), targets, reduction="sum")  # noqa: F841
            if c.parallel.pp == 1:
                del out  # autograd keeps no logits; a pipeline schedule keeps every stage's output
    return tracker.alive(exclude) - (8 if part.norm is not None else 0)  # less the loss itself


ACTIVATION_CASES = {
    "single": (1, ["train.micro_batch_size=2", "train.seq_len=64"], 0),
    "dp2": (2, ["parallel.dp_shard=2", "train.micro_batch_size=2", "train.seq_len=64"], 0),
    "dp2-pp2-last": (4, ["parallel.dp_shard=2", "parallel.pp=2", "train.micro_batch_size=2", "train.seq_len=64"], 1),
    "tp2": (2, ["parallel.tp=2", "train.micro_batch_size=2", "train.seq_len=64"], 0),
    "tp2-no-sp-tied": (2, ["parallel.tp=2", "parallel.sequence_parallel=false", "model.tie_embeddings=true",
                           "train.micro_batch_size=3", "train.seq_len=40", "train.global_batch_size=12"], 0),
    "tp4": (4, ["parallel.tp=4", "model.n_heads=8", "model.n_kv_heads=4", "train.micro_batch_size=1"], 0),
    "tp2-pp3-middle": (6, ["parallel.tp=2", "parallel.pp=3", "model.n_layers=5", "train.global_batch_size=6",
                           "train.micro_batch_size=1", "train.seq_len=128"], 1),
    "tp2-pp3-last": (6, ["parallel.tp=2", "parallel.pp=3", "model.n_layers=5", "train.global_batch_size=6",
                         "train.micro_batch_size=1", "train.seq_len=128"], 2),
    "single-documents": (1, ["data.document_masking=true", "data.reset_positions=true", "train.micro_batch_size=2",
                             "train.seq_len=64"], 0),
    "tp2-pp2-documents": (4, ["data.document_masking=true", "parallel.tp=2", "parallel.pp=2",
                              "train.micro_batch_size=2", "train.seq_len=64"], 1),
    # Mixtures of experts: router variants, shared experts, dense and MoE blocks apart
    "moe": (1, ["model=tiny_moe", "train.micro_batch_size=2", "train.seq_len=64"], 0),
    "moe-sigmoid-unnormalized": (1, ["model=tiny_moe", "model.moe.router=sigmoid", "model.moe.norm_topk_prob=false",
                                     "model.moe.aux_loss_coef=0", "train.micro_batch_size=3", "train.seq_len=32",
                                     "train.global_batch_size=12"], 0),
    "moe-shared-every2-pp2-last": (4, ["model=tiny_moe", "model.moe.shared_experts=1", "model.moe.every=2",
                                       "model.moe.router=sigmoid", "parallel.pp=2", "parallel.dp_shard=2",
                                       "train.micro_batch_size=2", "train.seq_len=64"], 1),
    "moe-tp2-shared": (2, ["model=tiny_moe", "parallel.tp=2", "model.moe.shared_experts=1",
                           "train.micro_batch_size=2", "train.seq_len=64"], 0),
}


@pytest.mark.parametrize("name", list(ACTIVATION_CASES))
def test_activation_bytes_per_microbatch(name):
    """Every checkpointing mode in float32 and bfloat16, against what the CPU kernels keep."""
    world, overrides, pp_rank = ACTIVATION_CASES[name]
    cfg, c = _config([*overrides, "train.device=cpu"], world)
    measured = in_fork(measured_activations, c, world, pp_rank)
    for (mode, dtype), kept in measured.items():
        variant = copy.deepcopy(cfg)
        variant.model.activation_checkpoint, variant.train.param_dtype = mode, str(dtype).split(".")[1]
        (predicted,) = predict(variant, world).ranks[pp_rank].activation_per_microbatch.values()
        assert abs(predicted - kept) <= 0.01 * kept, (mode, dtype, predicted, kept)


@pytest.mark.fast
def test_checkpointing_and_parallelism_shrink_activations_in_order():
    sizes = {}
    for mode in ("none", "op", "selective", "full"):
        sizes[mode] = predict(compose([f"model.activation_checkpoint={mode}"]), 1).activation_bytes
    assert sizes["full"] < sizes["selective"] < sizes["none"] and sizes["op"] < sizes["none"]
    sp = predict(compose(["parallel.tp=2", "train.micro_batch_size=16"]), 2).activation_bytes
    no_sp = predict(compose(["parallel.tp=2", "parallel.sequence_parallel=false", "train.micro_batch_size=16"]),
                    2).activation_bytes
    assert sp < no_sp < 2 * sp


def ep_activations(rank: int, port: int, overrides: list[str], result) -> None:
    """One of two gloo ranks (ep2): what a micro batch keeps, per mode and dtype, and the token
    copies each MoE block routed and received (routing is not balanced; the planner assumes it is)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        _, c = _config(overrides, 2)
        meshes = build_mesh(ParallelDims.from_config(c.parallel), "cpu", ep=2)
        rows: list[tuple[int, int]] = []
        dispatch = AllToAllDispatch.__call__

        def counted(self, x, counts, experts):
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)  # the counts the dispatch swaps
            rows.append((x.shape[0], int(received.sum())))
            return dispatch(self, x, counts, experts)

        AllToAllDispatch.__call__ = counted
        out = {}
        for mode in ("none", "op"):
            for dtype in DTYPES:
                rows.clear()
                out[(mode, dtype)] = (_stage_activations(c, meshes, 0, mode, dtype), list(rows))
        result.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_expert_parallel_activation_bytes():
    """ep2: the planner's count under balanced routing, plus what each received copy more or fewer
    keeps on the rank (its experts' hiddens and, with no checkpointing, its row in expert order,
    its expert output and its int64 position; under op the experts' matmul outputs): exact."""
    overrides = ["model=tiny_moe", "parallel.ep=2", "train.micro_batch_size=2", "train.seq_len=64", "train.device=cpu"]
    cfg, _ = _config(overrides, 2)
    ctx = multiprocessing.get_context("fork")
    result = ctx.SimpleQueue()
    with socket.socket() as probe:  # a free port for the two ranks' store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [ctx.Process(target=ep_activations, args=(rank, port, overrides, result)) for rank in range(2)]
    for proc in procs:
        proc.start()
    measured = dict(result.get() for _ in procs)[0]
    for proc in procs:
        proc.join(timeout=60)
    D, He, E = cfg.model.dim, cfg.model.moe.expert_ffn_dim, cfg.model.moe.num_experts
    for (mode, dtype), (kept, rows) in measured.items():
        c = dtype.itemsize
        per_row = 4 * c * He + 2 * c * D + 8 if mode == "none" else 2 * c * He + c * D
        # This harness casts the whole model to ``dtype`` first, so the bf16 copies the experts
        # make of their weights in training (no expert_dp rank here) are not made; the dry-run peak
        # tests (tests/test_dryrun.py) cover them.
        cast = 3 * (E // 2) * He * D * c * cfg.model.n_layers if mode == "none" and c < 4 else 0
        variant = copy.deepcopy(cfg)
        variant.model.activation_checkpoint, variant.train.param_dtype = mode, str(dtype).split(".")[1]
        (planned,) = predict(variant, 2).ranks[0].activation_per_microbatch.values()
        assert len(rows) == cfg.model.n_layers and any(sent != received for sent, received in rows)
        assert kept == planned - cast + sum(received - sent for sent, received in rows) * per_row, (mode, dtype)
