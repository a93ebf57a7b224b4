"""What the planner reasons about: a layout (degrees, ZeRO stage, schedule, batch, checkpointing)
read from a validated config, and the model's parameters with the dimension tensor parallelism
splits, placed on pipeline stages exactly as ``parallel3d.parallel.pipeline`` places them.

Everything here is plain arithmetic on shapes: no process group, no tensor, so the planner can
score hundreds of layouts of a 405B model in seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

from parallel3d.base import resolve_device
from parallel3d.config.schema import MoEConfig
from parallel3d.models.lora import canonical_targets
from parallel3d.optim.muon import is_muon_parameter
from parallel3d.parallel.mesh import ParallelDims
from parallel3d.parallel.pipeline import layer_split, stage_ids, stages_per_rank
from parallel3d.parallel.tensor import block_splits, outer_splits

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Master weights, gradients and AdamW moments: the model is built in float32 and stays so;
# mixed precision casts copies (FSDP's MixedPrecisionPolicy, in every layout) for compute only.
MASTER_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama model that memory and traffic depend on."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    tie_embeddings: bool
    attention_head_dim: int = 0  # 0: dim // n_heads
    qk_norm: bool = False
    num_experts: int = 0  # model.moe.*: 0 for a dense model
    top_k: int = 0
    expert_ffn_dim: int = 0
    shared_experts: int = 0
    moe_every: int = 1
    aux_loss: bool = False  # model.moe.aux_loss_coef > 0: its counts are summed over the ranks of a sequence
    router: str = "softmax"
    norm_topk_prob: bool = True
    first_dense_layers: int = 0
    attention: str = "gqa"  # model.attention; mla: the sizes below (models/mla.py)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    lora_rank: int = 0  # model.lora.rank: > 0 freezes the model and adds adapters to lora_targets
    lora_targets: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, m) -> "ModelShape":
        moe, lora = m.moe, m.lora
        mla = {k: getattr(m, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "v_head_dim")} if m.attention == "mla" else {}
        kv_heads = m.n_heads if m.attention == "mla" else m.n_kv_heads  # every MLA head has its own k and v
        return cls(m.dim, m.n_layers, m.n_heads, kv_heads, m.ffn_dim, m.vocab_size, bool(m.tie_embeddings),
                   m.head_dim, bool(m.qk_norm), moe.num_experts, moe.top_k, moe.expert_ffn_dim or m.ffn_dim,
                   moe.shared_experts, moe.every, moe.aux_loss_coef > 0, moe.router, bool(moe.norm_topk_prob),
                   moe.first_dense_layers, m.attention, **mla, lora_rank=lora.rank,
                   lora_targets=canonical_targets(lora.targets) if lora.rank else ())

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def moe(self) -> MoEConfig:
        """As ``ModelConfig.moe``, for code that takes either (``models.flops_per_token``)."""
        return MoEConfig(num_experts=self.num_experts, top_k=self.top_k, expert_ffn_dim=self.expert_ffn_dim,
                         shared_experts=self.shared_experts, every=self.moe_every,
                         first_dense_layers=self.first_dense_layers)

    def is_moe(self, layer: int) -> bool:
        """As ``models.moe.is_moe_layer``."""
        return self.num_experts > 0 and (layer + 1) % self.moe_every == 0 and layer >= self.first_dense_layers

    @property
    def qk_head_dim(self) -> int:
        """Channels of a query or key head (MLA: RoPE-free and RoPE parts)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.attention == "mla" else self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class Layout(ParallelDims):
    """One way to run a model on ``world_size`` ranks (a validated config, flattened): the mesh's
    degrees (``dp``, ``world_size`` from ParallelDims) and what else decides memory and time."""

    zero_stage: int
    cp_method: str = "alltoall"
    sequence_parallel: bool = True
    pp_schedule: str = "1F1B"
    stages_per_rank: int = 1  # v: pipeline stages each pp rank runs (looped / V schedules)
    layers_per_stage: Optional[tuple[int, ...]] = None  # blocks per stage; None: the even split
    global_batch_size: int = 16
    micro_batch_size: int = 2
    seq_len: int = 64
    pp_microbatches: Optional[int] = None  # microbatches per schedule step; None: all of them
    activation_checkpoint: str = "none"
    activation_checkpoint_every: int = 2
    fsdp_prefetch: int = 0
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    device: str = "cuda"  # whose kernels the activation model counts (cpu: composite RMSNorm, ...)
    document_masking: bool = False  # data.document_masking: attention keeps a (b, 1, s, s) mask
    reset_positions: bool = False  # data.reset_positions: each block gathers per-token RoPE tables
    ep: int = 1  # expert parallelism: experts split over ep ranks of dp_shard x cp x tp, sharded over the rest
    optimizer: str = "adamw"  # optim.name: muon keeps one state tensor per block matrix; shares Newton–Schulz out
    # ft.enabled: replica groups (this layout is one group's, its share of the global batch) whose
    # gradients are all-reduced across the groups every step, after the group's own reduction
    ft_replicas: int = 1
    ft_sync_every: int = 1  # ft.semi_sync=diloco: steps between two cross-group all-reduces (inner_steps)

    @classmethod
    def from_config(cls, cfg, device: str | None = None) -> "Layout":
        """From a config that ``validate.check`` has resolved (dp_shard >= 1, zero_stage set)."""
        p, t, m = cfg.parallel, cfg.train, cfg.model
        ft = getattr(cfg, "ft", None)
        replicas = ft.replicas if ft is not None and ft.enabled else 1
        every = ft.diloco.inner_steps if replicas > 1 and ft.semi_sync == "diloco" else 1
        return cls(
            dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, cp=p.cp, cp_method=p.cp_method,
            zero_stage=p.zero_stage,
            sequence_parallel=bool(p.sequence_parallel), pp_schedule=p.pp_schedule,
            stages_per_rank=stages_per_rank(p.pp_schedule, p.pp_stages_per_rank) if p.pp > 1 else 1,
            layers_per_stage=tuple(p.pp_layers_per_stage) if p.pp_layers_per_stage else None,
            global_batch_size=t.global_batch_size // replicas, micro_batch_size=t.micro_batch_size, seq_len=t.seq_len,
            pp_microbatches=p.pp_microbatches, activation_checkpoint=m.activation_checkpoint,
            activation_checkpoint_every=m.activation_checkpoint_every, fsdp_prefetch=p.fsdp_prefetch,
            param_dtype=t.param_dtype,
            reduce_dtype=t.reduce_dtype, device=resolve_device(t.device, device or "cuda"), ep=p.ep,
            document_masking=bool(cfg.data.document_masking), reset_positions=bool(cfg.data.reset_positions),
            optimizer=cfg.optim.name, ft_replicas=replicas, ft_sync_every=every,
        )

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def micro_batches(self) -> int:
        """Micro batches each data-parallel rank runs per optimizer step."""
        return self.global_batch_size // self.dp // self.micro_batch_size

    @property
    def schedule_microbatches(self) -> int:
        """Microbatches per pipeline schedule step (m in the bubble formulas)."""
        return self.pp_microbatches or self.micro_batches

    @property
    def schedule_steps(self) -> int:
        """Pipeline schedule steps per optimizer step (gradient accumulation over schedule steps)."""
        return self.micro_batches // self.schedule_microbatches if self.pp > 1 else 1

    @property
    def shards(self) -> int:
        """Ranks the model state is sharded over: all data-parallel ranks for ZeRO-1, dp_shard for
        ZeRO-2/3 (HSDP replicates the shards), none for DDP (see ``parallel/data.py``); times cp,
        whose ranks hold the same parameters (``mesh.py``)."""
        return {0: 1, 1: self.dp * self.cp}.get(self.zero_stage, self.dp_shard * self.cp)

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts under expert parallelism: dp x cp x tp / ep (``mesh.py``)."""
        return self.dp * self.cp * self.tp // self.ep

    @property
    def expert_shards(self) -> int:
        """Ranks the expert-parallel experts' model state is sharded over: expert_dp, none for DDP
        (``parallel.data.ExpertSharding``)."""
        return 1 if self.zero_stage == 0 else self.expert_dp

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype]

    def name(self) -> str:
        """Short label, e.g. ``dp8 tp8 pp2/Interleaved1F1Bx2 z1 mb1 ac=full``."""
        dp = f"hsdp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp{self.dp_shard}"
        pp = f"pp{self.pp}"
        if self.pp > 1:
            pp += f"/{self.pp_schedule}" + (f"x{self.stages_per_rank}" if self.stages_per_rank > 1 else "")
        cp = f" cp{self.cp}/{self.cp_method}" if self.cp > 1 else ""
        return f"{dp}{cp} tp{self.tp} {pp} z{self.zero_stage} mb{self.micro_batch_size} ac={self.activation_checkpoint}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the full model: its shape and the dim tensor parallelism splits (None: replicated)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: Optional[int]
    expert: bool = False  # stacked experts (dim 0): split over ep, then sharded over expert_dp when ep > 1
    trainable: bool = True  # False: LoRA's frozen base, which has no gradient or optimizer state

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def muon(self) -> bool:
        """Whether ``optim.name=muon`` gives this parameter to Muon (``parallel3d.optim.muon``)."""
        return is_muon_parameter(self.name, len(self.shape))


def block_params(model: ModelShape, layer: int) -> list[ParamSpec]:
    """A transformer block's parameters with the splits of ``parallel.tensor.block_splits``:
    column-parallel wq wk wv w1 w3 split their output features (dim 0 of the weight), row-parallel
    wo w2 their input features (dim 1); the norms are replicated."""
    D, F, q, kv = model.dim, model.ffn_dim, model.n_heads * model.head_dim, model.kv_dim
    p = f"layers.{layer}."
    shapes = {"attention_norm": (D,), "attention.wq": (q, D), "attention.wk": (kv, D), "attention.wv": (kv, D),
              "attention.wo": (D, q), "ffn_norm": (D,), "feed_forward.w1": (F, D), "feed_forward.w2": (D, F),
              "feed_forward.w3": (F, D)}
    if model.attention == "mla":
        shapes |= mla_shapes(model)
    moe = model.is_moe(layer)  # a MoE feed-forward replaces the dense one
    splits = block_splits(model.attention, model.q_lora_rank)
    params = [ParamSpec(f"{p}{name}.weight", shapes[name], dim) for name, dim in splits.items()
              if not (moe and name.startswith("feed_forward."))]
    if model.qk_norm:
        params += [ParamSpec(p + f"attention.{n}.weight", (model.head_dim,), None) for n in ("q_norm", "k_norm")]
    return with_adapters(model, params + (moe_params(model, p + "feed_forward.") if moe else []))


def with_adapters(model: ModelShape, params: list[ParamSpec]) -> list[ParamSpec]:
    """Under LoRA: ``params`` frozen, and the adapters of the targeted projections among them, split
    as ``lora.adapter_placements`` splits them (A like a row-parallel base, B like a column one)."""
    if not model.lora_rank:
        return params
    r, adapters = model.lora_rank, []
    for spec in params:
        module = spec.name.removesuffix(".weight")
        if spec.expert or module.rsplit(".", 1)[-1] not in model.lora_targets:
            continue
        out_features, in_features = spec.shape
        adapters += [ParamSpec(f"{module}.lora_a", (r, in_features), 1 if spec.tp_dim == 1 else None),
                     ParamSpec(f"{module}.lora_b", (out_features, r), 0 if spec.tp_dim == 0 else None)]
    return [replace(spec, trainable=False) for spec in params] + adapters


def mla_shapes(model: ModelShape) -> dict[str, tuple[int, ...]]:
    """Weight shapes of multi-head latent attention's layers (``models.mla``)."""
    D, H, R, qk = model.dim, model.n_heads, model.kv_lora_rank, model.qk_head_dim
    return {"attention.wq": (H * qk, D), "attention.wq_a": (model.q_lora_rank, D),
            "attention.q_norm": (model.q_lora_rank,), "attention.wq_b": (H * qk, model.q_lora_rank),
            "attention.wkv_a": (R + model.qk_rope_head_dim, D), "attention.kv_norm": (R,),
            "attention.wkv_b": (H * (model.qk_nope_head_dim + model.v_head_dim), R),
            "attention.wo": (D, H * model.v_head_dim)}


def swiglu_params(prefix: str, D: int, F: int) -> list[ParamSpec]:
    return [ParamSpec(prefix + "w1.weight", (F, D), 0), ParamSpec(prefix + "w2.weight", (D, F), 1),
            ParamSpec(prefix + "w3.weight", (F, D), 0)]


def moe_params(model: ModelShape, prefix: str) -> list[ParamSpec]:
    """A MoE feed-forward (``models.moe.MoE``): router, stacked experts, shared experts."""
    D, H, E = model.dim, model.expert_ffn_dim, model.num_experts
    experts = [ParamSpec(prefix + "experts.w1", (E, H, D), None, expert=True),
               ParamSpec(prefix + "experts.w2", (E, D, H), None, expert=True),
               ParamSpec(prefix + "experts.w3", (E, H, D), None, expert=True)]
    shared = swiglu_params(prefix + "shared.", D, model.shared_experts * H) if model.shared_experts else []
    return [ParamSpec(prefix + "router.gate.weight", (E, D), None), *experts, *shared]


def embedding_param(model: ModelShape) -> ParamSpec:
    """Split over the vocabulary when tied (it is the output projection too), else over its dim
    (``parallel.tensor.outer_plan``)."""
    return ParamSpec("tok_embeddings.weight", (model.vocab_size, model.dim),
                     outer_splits(model.tie_embeddings)["tok_embeddings"], trainable=not model.lora_rank)


def head_params(model: ModelShape, holds_embedding: bool) -> list[ParamSpec]:
    """The last stage's norm and output projection. A tied model projects with the embedding:
    one matrix when the stage embeds too, else the stage's own copy of it."""
    splits = outer_splits(model.tie_embeddings)
    norm = ParamSpec("norm.weight", (model.dim,), splits["norm"], trainable=not model.lora_rank)
    if not model.tie_embeddings:
        return [norm, ParamSpec("output.weight", (model.vocab_size, model.dim), splits["output"],
                                trainable=not model.lora_rank)]
    return [norm] if holds_embedding else [norm, embedding_param(model)]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage (the whole model when pp = 1): which parts of the model it holds."""

    index: int
    blocks: range
    first: bool  # embeds tokens
    last: bool  # final norm, output projection and loss

    def params(self, model: ModelShape) -> list[ParamSpec]:
        """The stage's parameters, as ``pipeline.stage_model`` keeps them (a tied last stage holds
        its own copy of the embedding as the output projection)."""
        out = [embedding_param(model)] if self.first else []
        for layer in self.blocks:
            out += block_params(model, layer)
        if self.last:
            out += head_params(model, holds_embedding=self.first)
        return out

    def counted_params(self, model: ModelShape) -> list[tuple[ParamSpec, int]]:
        """The same, as (parameter, how many): blocks are alike, so a 126-layer stage costs as
        little to plan as one block (names are those of the first block)."""
        out = [(embedding_param(model), 1)] if self.first else []
        for kind in (False, True):  # dense blocks, then MoE blocks
            alike = [layer for layer in self.blocks if model.is_moe(layer) == kind]
            if alike:
                out += [(spec, len(alike)) for spec in block_params(model, alike[0])]
        if self.last:
            out += [(spec, 1) for spec in head_params(model, holds_embedding=self.first)]
        return out


def rank_stages(layout: Layout, n_layers: int, pp_rank: int) -> list[Stage]:
    """The stages pipeline rank ``pp_rank`` runs, in stage order (see ``pipeline.build_parts``)."""
    total = layout.num_stages
    split = layer_split(n_layers, total, list(layout.layers_per_stage) if layout.layers_per_stage else None)
    ids = stage_ids(pp_rank, layout.pp, layout.stages_per_rank, layout.pp_schedule) if layout.pp > 1 else [0]
    return [Stage(i, split[i], first=i == 0, last=i == total - 1) for i in sorted(ids)]
