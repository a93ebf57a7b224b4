"""Per-rank memory: the model state (exact) and the buffers that come and go in a step (estimated).

Model state is what ``metrics.model_state_bytes`` counts on a rank: the local shards of the
parameters, of their gradients and of the optimizer's state tensors. It follows the code, not
an idealization:

* tensor parallelism divides a weight's split dim by tp (validation makes it divide evenly);
  norms stay whole on every tp rank;
* FSDP shards the tp-local tensor's dim 0 like ``torch.chunk``, over all data-parallel ranks
  (ZeRO-1) or over ``dp_shard`` (ZeRO-2/3): ``ceil(rows / n)`` rows per rank, the last ones
  fewer (or none), so data-parallel rank 0 holds the most; HSDP's ``dp_replicate`` copies
  shards, it does not divide them; after a step parameters, gradients and optimizer state are
  all sharded alike (what ZeRO-1 and 2 hold whole during the step is transient, below);
  DDP keeps everything whole;
* AdamW keeps ``exp_avg`` and ``exp_avg_sq`` like the (sharded) parameter plus a float32
  ``step`` scalar tensor per parameter: 4 bytes that ``model_state_bytes`` counts too;
* under ``optim.name=muon`` the blocks' matrices keep one ``momentum_buffer`` each, sharded like
  the parameter, and no ``step``; the rest keeps AdamW's state;
* a tied last pipeline stage holds its own copy of the embedding (with gradient and state);
* expert-parallel experts: 1/ep of the experts, sharded over expert_dp by the ZeRO stage;
* under LoRA the base is frozen (its weights only) and the adapters hold all three.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parallel3d.planner.layout import MASTER_BYTES, Layout, ModelShape, ParamSpec, Stage, block_params

ADAM_STEP_BYTES = 4  # AdamW's per-parameter ``step``: a float32 scalar tensor (torch.optim._get_scalar_dtype)
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq
MUON_MOMENTS = 1  # momentum_buffer
NS_BYTES = 2  # Muon's Newton–Schulz runs (and its exchange moves the update) in bfloat16


def chunk_rows(rows: int, n: int, rank: int) -> int:
    """Rows of dim 0 that ``rank`` of ``n`` holds under torch.chunk semantics (FSDP2 and ZeRO-1)."""
    per_rank = -(-rows // n)
    return max(0, min(per_rank, rows - rank * per_rank))


def tp_local_shape(spec: ParamSpec, tp: int) -> tuple[int, ...]:
    if spec.tp_dim is None or tp == 1:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.tp_dim] //= tp
    return tuple(shape)


@dataclass(frozen=True)
class ModelState:
    param_bytes: int = 0
    grad_bytes: int = 0
    optim_state_bytes: int = 0

    def __add__(self, other: "ModelState") -> "ModelState":
        return ModelState(self.param_bytes + other.param_bytes, self.grad_bytes + other.grad_bytes,
                          self.optim_state_bytes + other.optim_state_bytes)

    def __mul__(self, count: int) -> "ModelState":
        return ModelState(count * self.param_bytes, count * self.grad_bytes, count * self.optim_state_bytes)

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_state_bytes


def param_state(spec: ParamSpec, layout: Layout, dp_rank: int = 0) -> ModelState:
    """Bytes one rank holds for one parameter; ``dp_rank`` is its coordinate in the flattened
    data-parallel mesh (dp_replicate outer, dp_shard inner), 0 holding the most."""
    shape = tp_local_shape(spec, layout.tp)
    rows, row_numel = shape[0], math.prod(shape[1:])
    n = layout.shards
    if spec.expert and layout.ep > 1:
        rows, n = expert_local_shape(spec, layout, dp_rank)[0], 1
    local = chunk_rows(rows, n, dp_rank % n) * row_numel * MASTER_BYTES
    if not spec.trainable:  # LoRA's frozen base: the weight alone
        return ModelState(local, 0, 0)
    if layout.optimizer == "muon" and spec.muon:
        return ModelState(local, local, MUON_MOMENTS * local)
    return ModelState(local, local, ADAM_MOMENTS * local + ADAM_STEP_BYTES)


def expert_local_shape(spec: ParamSpec, layout: Layout, dp_rank: int = 0) -> tuple[int, ...]:
    """A rank's part of stacked experts under expert parallelism: 1/ep of the experts, then (ZeRO
    1-3) chunked over expert_dp (``parallel.data.ExpertSharding``)."""
    experts = spec.shape[0] // layout.ep
    n = layout.expert_shards
    return (chunk_rows(experts, n, dp_rank % n), *spec.shape[1:])


def stage_model_state(model: ModelShape, stage: Stage, layout: Layout, dp_rank: int = 0) -> ModelState:
    """Model state of one pipeline stage on the rank with data-parallel coordinate ``dp_rank``."""
    return sum((param_state(spec, layout, dp_rank) * count for spec, count in stage.counted_params(model)),
               ModelState())


def unsharded_numel(spec: ParamSpec, layout: Layout) -> int:
    """Elements of one parameter that data parallelism unshards (or casts a copy of) on a rank: its
    tp-local tensor; under expert parallelism the experts' 1/ep, and none where no other rank holds
    the same experts (expert_dp = 1): then they belong to no data-parallel unit and cast themselves
    (``planner.activations.expert_cast_bytes``)."""
    numel = math.prod(tp_local_shape(spec, layout.tp))
    if spec.expert and layout.ep > 1:
        return 0 if layout.expert_dp == 1 else numel // layout.ep
    return numel


def unsharded_gradient_bytes(model: ModelShape, stage: Stage, layout: Layout) -> int:
    """FSDP's unsharded gradients of a pipeline stage, accumulated (reduce dtype) over a schedule step."""
    if layout.pp == 1 or layout.shards == 1:
        return 0
    unsharded = sum(n * unsharded_numel(p, layout) for p, n in stage.counted_params(model) if p.trainable)
    return layout.reduce_bytes * unsharded + own_expert_gradient_bytes(model, stage, layout)


def own_expert_gradient_bytes(model: ModelShape, stage: Stage, layout: Layout) -> int:
    """Experts in no data-parallel unit (ep with expert_dp = 1) accumulate float32 ``.grad`` of
    their own from their first backward: present at a peak where FSDP's sharded gradients are not."""
    if layout.ep == 1 or layout.expert_dp > 1:
        return 0
    return MASTER_BYTES * sum(n * math.prod(expert_local_shape(p, layout)) for p, n in stage.counted_params(model)
                              if p.expert and p.trainable)


def transient_bytes(model: ModelShape, stages: list[Stage], layout: Layout, block_peak: int) -> int:
    """An estimate of the memory that comes and goes within a step on top of the model state
    and the stored activations (a measured peak includes it, the model state does not):

    * FSDP's unsharded parameters (compute dtype) and unsharded gradients (reduce dtype): ZeRO-3
      holds the root (embedding, final norm, output) for the whole micro batch and the block being
      computed plus the prefetched one(s), ZeRO-2 every block from forward to backward; ZeRO-1
      accumulating over several micro batches keeps the parameters and accumulated gradients
      unsharded for the whole step, and any stage under pipelining its parameters (its gradients
      accumulate from the stage's first backward on: ``unsharded_gradient_bytes``, counted where
      the schedule replays it). DDP in a lower compute precision holds a cast copy.
    * the loss's backward: the gradients of the vocab-sharded log-probabilities and logits, float32;
    * ``block_peak``: what the block in backward rematerializes (checkpointing) or allocates for
      its gradients.
    """
    c, reduce = layout.compute_bytes, layout.reduce_bytes
    stage_numel = sum(n * unsharded_numel(p, layout) for s in stages for p, n in s.counted_params(model))
    layers = [layer for s in stages for layer in s.blocks]
    size = {moe: sum(unsharded_numel(p, layout) for p in block_params(model, layer))  # a dense and a MoE block
            for moe, layer in {model.is_moe(layer): layer for layer in layers}.items()}
    block = max(size.values(), default=0)  # the largest block
    if layout.shards > 1:
        if layout.pp > 1:  # the unsharded gradients: from each stage's first backward, planner.schedule
            gathered = stage_numel * c
        elif layout.zero_stage == 1 and layout.micro_batches > 1:
            gathered = stage_numel * (c + reduce) + sum(own_expert_gradient_bytes(model, s, layout) for s in stages)
        elif layout.zero_stage <= 2:
            gathered = stage_numel * c + block * reduce
        else:
            units = 1 + max(1, layout.fsdp_prefetch)  # the block in compute and the one prefetched
            blocks = sum(size[model.is_moe(layer)] for layer in layers)
            gathered = (stage_numel - blocks + units * block) * c + block * reduce
    else:
        gathered = stage_numel * c if c != MASTER_BYTES else 0
    tokens = layout.micro_batch_size * layout.seq_len
    loss = 2 * 4 * tokens * model.vocab_size // layout.tp if any(s.last for s in stages) else 0
    return gathered + max(loss, block_peak, muon_step_bytes(model, stages, layout))


def muon_step_bytes(model: ModelShape, stages: list[Stage], layout: Layout) -> int:
    """Muon's optimizer step (``parallel3d.optim.orthogonalise``), in bfloat16: every matrix's
    local update, the pieces on their way to the owners, the matrices an owner receives (its share,
    about what it holds), the results with their pieces on the way back and as they land (five
    times this rank's Muon elements), and Newton–Schulz's iterate, its Gram matrix and their
    products for the largest block matrix; 0 under AdamW."""
    if layout.optimizer != "muon":
        return 0
    muon = [(spec, count) for s in stages for spec, count in s.counted_params(model) if spec.muon and spec.trainable]
    if not muon:
        return 0
    local = sum(count * param_state(spec, layout).param_bytes // MASTER_BYTES for spec, count in muon)
    rows, cols = max((spec.shape[-2:] for spec, _ in muon), key=lambda shape: shape[0] * shape[1])
    small = min(rows, cols)
    return NS_BYTES * (5 * local + 3 * rows * cols + 3 * small * small)
