"""Communication per optimizer step: bytes each rank sends, by process group and collective.

Convention: ring algorithms, as NCCL runs them on one group of n ranks. A collective over S
bytes in total (the full tensor: what an all-gather produces, what a reduce-scatter or
all-reduce consumes) makes each rank send

    all_gather, reduce_scatter    S·(n-1)/n
    all_reduce                    2·S·(n-1)/n     (a reduce-scatter then an all-gather)
    all_to_all                    S·(n-1)/n       (S: this rank's input; it keeps 1/n of it)
    send_recv                     the bytes it sends (pipeline activations and their gradients)

Groups (the keys): ``dp`` is the flattened data-parallel group (dp_replicate x dp_shard) that DDP
and ZeRO-1 reduce over; ``dp_shard`` and ``dp_replicate`` are FSDP's (HSDP: reduce-scatter within
dp_shard, all-reduce of the shard across dp_replicate); ``tp``; ``pp``. Scalars (loss, grad norm)
are left out.

When the code communicates (see ``parallel/data.py`` and torch's pipelining stage):
* DDP all-reduces gradients once per optimizer step (no sync on the other micro batches); under
  pipelining once per schedule step. ZeRO-1 gathers the parameters and reduce-scatters the
  gradients once per step, over all data-parallel ranks (group ``dp``). Gradients travel in
  ``train.reduce_dtype``, FSDP gathers parameters in ``param_dtype``.
* ZeRO-2/3 reduce-scatter every micro batch. ZeRO-3 all-gathers each block in forward and again in
  backward and the root (embedding, final norm, output) once per micro batch (FSDP keeps the
  root gathered for backward); ZeRO-2 gathers everything once per micro batch. Under pipelining
  the schedule keeps parameters and accumulated gradients unsharded until its step ends, and
  ZeRO-3 does not reshard after forward there: one all-gather and one reduce-scatter per
  schedule step.
* Tensor parallelism per block and micro batch, S = b·s·dim·c: with sequence parallelism two
  all-gathers (before attention and the MLP) and two reduce-scatters (after wo and w2) in forward,
  the same mirrored in backward; without it two all-reduces each way. A recomputed block repeats
  some (``parallel/activation.py``): full checkpointing the two all-gathers and the reduction
  after wo, op-level the all-gathers only. The embedding reduces its vocab-parallel output, the
  output projection gathers its input, and loss parallel all-reduces 3 floats per token. Norm
  weights (and MLA's latent down-projections with their norms, ``parallel/tensor.py``) are
  replicated under sequence parallelism and their gradients partial sums, all-reduced
  each time the data-parallel wrapper reduces gradients (FSDP: every micro batch), or once per
  step without one.
* Fault tolerance (``ft.enabled``, group ``ft``): after the group's own reduction each rank
  all-reduces its gradient shard (DDP: all of it) once per step with the same rank of every other
  replica group, in ``reduce_dtype``, over ``ft.replicas`` members (``parallel3d/ft/replica.py``);
  under ``ft.semi_sync=diloco`` the float32 pseudo-gradient of the same shard once per
  ``ft.diloco.inner_steps`` steps, counted per step as its share (``parallel3d/ft/diloco.py``).
* Pipeline: each microbatch sends its activations (b·s·dim·c, s/tp under sequence parallelism)
  to the next stage on another rank and the gradient back; tied embeddings all-reduce the
  embedding gradient between the first and last stage (a group of two) once per step.
* Expert parallelism (``parallel/expert.py``), per MoE block and micro batch: the token copies
  (b·s·top_k·dim·c) go to their experts and the results come back, one all-to-all each way in
  forward and again in backward (and once more each way when full checkpointing recomputes the
  block). What a rank must send is the copies routed to experts elsewhere: (ep-1)/ep of them under
  balanced routing, the minimum any routing needs on average, and what is counted. The expert
  weights' data-parallel units run over the ``expert_dp`` ranks (dp x cp x tp / ep) that hold the
  same experts, by the ZeRO stage as above (dim 0 padded to a multiple of expert_dp). Under cp
  and tp each rank routes its shard of the sequence (b·s/(cp·tp) tokens). Before each dispatch
  the ranks swap their counts per expert (int64, all-to-all); the aux loss sums each sequence's
  expert counts over cp x tp (b·experts float32, an all-reduce per MoE block forward).
* Muon (``optim.name=muon``), once per optimizer step: each block matrix that FSDP or tp splits
  is orthogonalised whole by one rank of the group that holds its pieces (FSDP's data-parallel
  shards, tp's, or both: group ``dp_shard_tp`` and the like): one all-to-all in bfloat16 sends
  every piece to its matrix's owner, one sends the results' pieces back; stacked experts are
  split along the expert dim only and need nothing.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from parallel3d.optim.orthogonalise import held_piece, owners
from parallel3d.planner.activations import Geometry, checkpointed
from parallel3d.planner.layout import MASTER_BYTES, Layout, ModelShape, Stage, embedding_param
from parallel3d.planner.memory import NS_BYTES, expert_local_shape, param_state, tp_local_shape

GROUPS = ("dp", "dp_shard", "dp_replicate", "tp", "pp", "cp", "dp_cp", "dp_shard_cp", "cp_tp", "ep", "expert_dp",
          "ft", "dp_tp", "dp_cp_tp", "dp_shard_tp", "dp_shard_cp_tp")  # dp_tp ...: Muon's holders of FSDP x tp pieces


def ring(kind: str, total_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring ``kind`` collective over ``total_bytes`` on ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * total_bytes * (n - 1) / n


def padded_numel(model: ModelShape, stage: Stage, layout: Layout, n: int, blocks_only: bool = False) -> int:
    """Elements of the stage's tp-local parameters (or of its blocks' only), dim 0 padded to a
    multiple of n (FSDP's flat all-gather moves the padding too)."""
    total = 0
    for spec, count in stage.counted_params(model):
        if (blocks_only and not spec.name.startswith("layers.")) or (spec.expert and layout.ep > 1):
            continue  # (expert-parallel experts: FSDP ignores them)
        shape = tp_local_shape(spec, layout.tp)
        total += count * -(-shape[0] // n) * n * math.prod(shape[1:])
    return total


def stage_traffic(model: ModelShape, stages: list[Stage], layout: Layout) -> dict[str, dict[str, float]]:
    """Bytes one rank holding ``stages`` sends per optimizer step, by group and collective."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    c, reduce, mb = layout.compute_bytes, layout.reduce_bytes, layout.micro_batches
    piped = layout.pp > 1
    syncs = layout.schedule_steps if piped else 1  # gradient reductions deferred to the step's end
    # How often the data-parallel wrapper reduces gradients: ZeRO-2/3 every micro batch, DDP and
    # ZeRO-1 once, the pipeline schedule once per schedule step.
    reductions = syncs if piped else mb if layout.zero_stage >= 2 else 1
    n = layout.shards
    group, replicas = data_parallel_group(layout), layout.dp * layout.cp  # cp ranks hold the same parameters
    for stage in stages:
        if replicas > 1 and n == 1:  # DDP
            numel = padded_numel(model, stage, layout, 1)
            out[group]["all_reduce"] += reductions * ring("all_reduce", numel * reduce, replicas)
        elif replicas > 1:
            numel = padded_numel(model, stage, layout, n)
            gathered = reductions * numel  # once per reduction
            if layout.zero_stage == 3 and not piped:  # blocks again in backward
                gathered += mb * padded_numel(model, stage, layout, n, blocks_only=True)
            out[group]["all_gather"] += ring("all_gather", gathered * c, n)
            out[group]["reduce_scatter"] += reductions * ring("reduce_scatter", numel * reduce, n)
            if layout.zero_stage >= 2:  # HSDP: the reduced shard across the replicas
                out["dp_replicate"]["all_reduce"] += reductions * ring("all_reduce", numel * reduce / n,
                                                                       layout.dp_replicate)
        # Without data parallelism train.settle_gradients reduces once (FSDP on one rank, which
        # only casts, reduces nothing, and leaves the tensor-parallel partial sums to it).
        if layout.ft_replicas > 1:  # ft.enabled: this rank's reduced gradients, with the other groups' same rank
            local = padded_numel(model, stage, layout, n) // n  # its gradient shard (DDP: n = 1, all of it)
            # DiLoCo: the float32 pseudo-gradient of the same shard, once per ft_sync_every steps
            each = reduce if layout.ft_sync_every == 1 else MASTER_BYTES
            out["ft"]["all_reduce"] += ring("all_reduce", local * each, layout.ft_replicas) / layout.ft_sync_every
        if layout.tp > 1:
            _tensor_parallel(out["tp"], model, stage, layout, reductions if replicas > 1 else 1)
        if layout.cp > 1:
            _context_parallel(out["cp"], model, stage, layout)
    if piped:
        _pipeline(out["pp"], model, stages, layout)
    if layout.ep > 1:
        _expert_parallel(out, model, stages, layout, reductions)
    if model.aux_loss and layout.cp * layout.tp > 1:
        _aux_loss_counts(out, model, stages, layout)
    if layout.optimizer == "muon":
        _muon_exchange(out, model, stages, layout)
    return {group: dict(kinds) for group, kinds in out.items() if any(kinds.values())}


def _muon_exchange(out: dict, model: ModelShape, stages: list[Stage], layout: Layout) -> None:
    """Muon's step (``parallel3d.optim.orthogonalise``): each block matrix that data or tensor
    parallelism splits goes, in bfloat16, to the rank of its pieces' holders that orthogonalises
    it, and comes back: per group of holders, one all-to-all of every rank's pieces and one of
    each owner's whole matrices. Counted for the busiest holder (owners' shares differ by their
    matrices). Stacked experts are split along the expert dim only (whole matrices on every
    rank): none."""
    groups: dict[str, list[tuple[tuple[int, int], list[int], int]]] = defaultdict(list)
    for stage in stages:
        for spec, count in stage.counted_params(model):
            if not spec.muon or spec.expert:
                continue
            group, mesh_shape, placements = _muon_holders(spec, layout)
            if math.prod(mesh_shape) > 1:
                members = itertools.product(*(range(n) for n in mesh_shape))
                pieces = [math.prod(sum(b - a for a, b in runs) for runs in held_piece(spec.shape, placements,
                                                                                      mesh_shape, at))
                          for at in members]
                groups[group].append((spec.shape, pieces, count))
    for group, matrices in groups.items():
        shapes = [shape for shape, _, count in matrices for _ in range(count)]
        n = len(matrices[0][1])
        owned = [0] * n
        for shape, owner in zip(shapes, owners(shapes, n)):
            owned[owner] += math.prod(shape)
        sent = [ring("all_to_all", NS_BYTES * sum(count * pieces[g] for _, pieces, count in matrices), n)
                + ring("all_to_all", NS_BYTES * owned[g], n) for g in range(n)]
        out[group]["all_to_all"] += max(sent)


def _muon_holders(spec, layout: Layout) -> tuple[str, tuple[int, ...], list]:
    """The group holding a block matrix's pieces (named as the mesh dims it spans), its shape and
    the matrix's placements over it, as FSDP and tensor parallelism place it: FSDP's dim-0 shards
    (strided within a tp split of dim 0: FSDP shards the tp-local matrix), tp's split."""
    n = layout.shards
    t = layout.tp if spec.tp_dim is not None else 1
    names, mesh_shape, placements = [], [], []
    if n > 1:
        names.append(data_parallel_group(layout))
        mesh_shape.append(n)
        placements.append(_StridedShard(0, split_factor=t) if t > 1 and spec.tp_dim == 0 else Shard(0))
    if t > 1:
        names.append("tp")
        mesh_shape.append(t)
        placements.append(Shard(spec.tp_dim))
    return "_".join(names), tuple(mesh_shape), placements


def data_parallel_group(layout: Layout) -> str:
    """The mesh dim (``mesh.py``) gradients are reduced over: DDP and ZeRO-1 over all data-parallel
    ranks, ZeRO-2/3 over dp_shard; with cp, those times cp (flattened), or cp alone."""
    if layout.cp == 1:
        return "dp" if layout.zero_stage <= 1 else "dp_shard"
    if layout.zero_stage <= 1:
        return "dp_cp" if layout.dp > 1 else "cp"
    return "dp_shard_cp" if layout.dp_shard > 1 else "cp"


def _context_parallel(out: dict[str, float], model: ModelShape, stage: Stage, layout: Layout) -> None:
    """Per block and micro batch (``parallel/context.py``), q of T·H/t·hd and k, v of T·kv/t·hd
    elements each, T this rank's tokens (MLA: q and k of qk channels a head, v and the output of
    v_head_dim; its kv heads are its heads). alltoall: q, k, v and the output are exchanged once each
    in forward and their gradients in backward, k and v with their heads replicated up to
    lcm(kv/t, cp); ring: k and v go n - 1 hops in forward, again in backward together with their
    gradients. A block recomputed under activation checkpointing repeats its forward's part."""
    g, n = Geometry.of(layout), layout.cp
    width = model.qk_head_dim + model.value_head_dim  # a head's q and output, or k and v (MLA: 192 + 128)
    q_bytes = g.tokens * model.n_heads // g.t * width * g.c  # q and the output
    kv_heads = model.n_kv_heads // g.t
    forwards = sum(1 + (checkpointed(layer, layout) != "none") for layer in stage.blocks)
    if layout.cp_method == "alltoall":
        kv_bytes = g.tokens * math.lcm(kv_heads, n) * width * g.c
        per_pass = ring("all_to_all", q_bytes + kv_bytes, n)
        out["all_to_all"] += layout.micro_batches * (forwards + len(stage.blocks)) * per_pass
    else:
        kv_bytes = g.tokens * kv_heads * width * g.c
        hops = (n - 1) * kv_bytes
        out["send_recv"] += layout.micro_batches * (forwards + 2 * len(stage.blocks)) * hops


def _tensor_parallel(out: dict[str, float], model: ModelShape, stage: Stage, layout: Layout,
                     norm_reductions: int) -> None:
    g = Geometry.of(layout)
    t, mb, sp = layout.tp, layout.micro_batches, layout.sequence_parallel
    # One full-sequence activation, S, in the compute dtype: the matmuls' outputs and the norms'
    # (and in backward the gradients of them). The residual stream is in it too (``parallel/data.py``).
    act = res = g.tokens * model.dim * g.c
    # Per block and micro batch, forward: 2 gathers of norm outputs (SP), 2 reductions of matmul
    # outputs; backward the reverse on their gradients; plus what a recomputed block repeats.
    regathers = rereductions = 0
    for layer in stage.blocks:
        mode = checkpointed(layer, layout)
        regathers += 2 if mode in ("full", "op") else 0
        rereductions += 1 if mode == "full" else 0
    # MoE blocks route each rank's sequence shard: their feed-forward gathers nothing, unless its
    # shared experts (split as a dense one) need the whole sequence.
    moe_blocks = sum(model.is_moe(layer) for layer in stage.blocks)
    n = 2 * len(stage.blocks) - (0 if model.shared_experts else moe_blocks)
    # The output projection gathers its input (SP) and reduces its input's gradient. A tied
    # embedding, split over the vocabulary, reduces its output; an untied one, split over its dim,
    # sends each rank's slice of every token to the token's sequence shard and back (all-to-all;
    # gloo has none, DTensor all-gathers the sequence instead), or gathers it without SP. All of
    # them are residual-stream tensors.
    tied_first = stage.first and model.tie_embeddings
    untied_first = stage.first and not model.tie_embeddings
    norm_side = n + stage.last + tied_first
    if sp:
        out["all_gather"] += mb * ((norm_side + regathers) * ring("all_gather", res, t)
                                   + n * ring("all_gather", act, t))
        out["reduce_scatter"] += mb * ((n + rereductions) * ring("reduce_scatter", act, t)
                                       + norm_side * ring("reduce_scatter", res, t))
        if untied_first and g.cpu:
            out["all_gather"] += 2 * mb * ring("all_gather", res, t)
        elif untied_first:
            out["all_to_all"] += 2 * mb * ring("all_to_all", res / t, t)
        norms = 2 * len(stage.blocks) + stage.last  # replicated norm weights, partial gradients
        # and the MoE weights replicated over tp: the router, the experts unless ep splits them
        experts = 0 if layout.ep > 1 else 3 * model.num_experts * model.expert_ffn_dim
        replicated = norms * model.dim + moe_blocks * (model.num_experts + experts) * model.dim
        out["all_reduce"] += norm_reductions * ring("all_reduce", replicated * MASTER_BYTES, t)
    else:
        out["all_reduce"] += mb * ((n + rereductions) * ring("all_reduce", act, t)
                                   + norm_side * ring("all_reduce", res, t))
        if untied_first:
            out["all_gather"] += mb * ring("all_gather", res, t)
    if model.attention == "mla":  # its replicated latent down-projections and their norms, with or without SP
        R, Rq = model.kv_lora_rank + model.qk_rope_head_dim, model.q_lora_rank
        latent = len(stage.blocks) * ((Rq + R) * model.dim + Rq + model.kv_lora_rank)
        out["all_reduce"] += norm_reductions * ring("all_reduce", latent * MASTER_BYTES, t)
    if stage.last:  # loss parallel: max, sum of exponentials and the target's logit per token
        out["all_reduce"] += mb * ring("all_reduce", 3 * g.tokens * 4, t)


def _pipeline(out: dict[str, float], model: ModelShape, stages: list[Stage], layout: Layout) -> None:
    g = Geometry.of(layout)
    act = g.tokens_norm * model.dim * g.c  # hidden states, in the compute dtype
    held = {s.index for s in stages}
    for stage in stages:
        sends = (not stage.last and stage.index + 1 not in held) + (not stage.first and stage.index - 1 not in held)
        out["send_recv"] += layout.micro_batches * sends * act
    first_and_last = {0, layout.num_stages - 1}
    if model.tie_embeddings and len(held & first_and_last) == 1:  # the two copies live on two ranks
        grad = param_state(embedding_param(model), layout).grad_bytes
        out["all_reduce"] += ring("all_reduce", grad, 2)



def _moe_forwards(model: ModelShape, stages: list[Stage], layout: Layout) -> int:
    """MoE block forwards per micro batch, a recomputed block's replay in backward included."""
    return sum(1 + (checkpointed(layer, layout) != "none") for stage in stages for layer in stage.blocks
               if model.is_moe(layer))


def _aux_loss_counts(out: dict, model: ModelShape, stages: list[Stage], layout: Layout) -> None:
    """Each MoE block forward sums its sequences' expert counts (b x experts float32) over the
    ranks that split the sequences (``models.moe.MoE.balance_loss``): cp x tp, flattened."""
    group = "cp_tp" if layout.cp > 1 and layout.tp > 1 else "cp" if layout.cp > 1 else "tp"
    counts = layout.micro_batch_size * model.num_experts * 4
    forwards = _moe_forwards(model, stages, layout)
    out[group]["all_reduce"] += layout.micro_batches * forwards * ring("all_reduce", counts, layout.cp * layout.tp)


def _expert_parallel(out: dict, model: ModelShape, stages: list[Stage], layout: Layout, reductions: int) -> None:
    """Token copies to their experts and back: every copy (dropless routing; with a capacity factor
    an upper bound, as dropped copies stay home)."""
    tokens = layout.micro_batch_size * layout.seq_len // (layout.cp * layout.tp)  # a rank routes its shard
    copies = tokens * model.top_k * model.dim * layout.compute_bytes
    # Dispatch and combine, forward and backward; a recomputed block (full, or op: its combine's
    # output is not a matmul's, so the replay reaches both exchanges) sends both again.
    exchanges = sum(4 + 2 * (checkpointed(layer, layout) != "none") for stage in stages for layer in stage.blocks
                    if model.is_moe(layer))
    out["ep"]["all_to_all"] += layout.micro_batches * exchanges * ring("all_to_all", copies, layout.ep)
    # Before each dispatch (forward, and a recomputed forward) the ranks swap their tokens' counts
    # per expert (int64), which size the exchange.
    counts = model.num_experts * 8
    out["ep"]["all_to_all"] += layout.micro_batches * _moe_forwards(model, stages, layout) * ring("all_to_all", counts, layout.ep)
    n = layout.expert_dp
    if n == 1:
        return
    # The experts' own data-parallel units over expert_dp, as the dense weights' over dp (above);
    # they live in blocks, so ZeRO-3 gathers them in forward and again in backward.
    shards = layout.expert_shards
    numel = sum(count * math.prod(expert_local_shape(spec, layout)) * shards
                for stage in stages for spec, count in stage.counted_params(model) if spec.expert)
    if shards == 1:
        out["expert_dp"]["all_reduce"] += reductions * ring("all_reduce", numel * layout.reduce_bytes, n)
        return
    gathered = reductions * numel
    if layout.zero_stage == 3 and layout.pp == 1:
        gathered += layout.micro_batches * numel
    out["expert_dp"]["all_gather"] += ring("all_gather", gathered * layout.compute_bytes, n)
    out["expert_dp"]["reduce_scatter"] += reductions * ring("reduce_scatter", numel * layout.reduce_bytes, n)
