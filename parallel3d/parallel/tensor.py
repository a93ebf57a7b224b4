"""Tensor parallelism: which layer is split how, as DTensor ``parallelize_module`` plans.

Megatron-style: column-parallel q/k/v/w1/w3 (each rank computes some heads / some hidden units),
row-parallel wo/w2 (partial sums reduced back), a vocabulary-parallel embedding and output
projection, and the loss computed on vocab-sharded logits (``loss_parallel``) so the full logits
never exist on one rank.

With sequence parallelism (default) the residual stream between blocks is split along the
sequence: norms run on 1/tp of the tokens, and the all-reduce after wo/w2 becomes a
reduce-scatter plus an all-gather before the next column-parallel layer (same bytes, 1/tp of the
activation memory). Without it the residual stream is replicated and wo/w2 all-reduce.

    layer                   sequence parallel (default)              without
    tok_embeddings          colwise over dim -> Shard(1) (seq)       colwise over dim -> Replicate
    (tied tok_embeddings)   rowwise over vocab -> Shard(1) (seq)     rowwise over vocab -> Replicate
    attention_norm/ffn_norm SequenceParallel                         ReplicateParallel
    attention/feed_forward  gather the sequence: Shard(1)->Replicate input as a Replicate DTensor
    wq wk wv w1 w3          colwise                                  colwise
    wo w2                   rowwise -> Shard(1)                      rowwise -> Replicate
    norm                    SequenceParallel                         ReplicateParallel
    output                  colwise, Shard(1) in -> Shard(-1) out    colwise, Replicate in -> Shard(-1) out
    (tied output)           norm output gathered, F.linear with the vocab-sharded embedding weight

Every parameter of a tensor-parallel model is a DTensor on the tp mesh, the norms' included: the
optimizer's multi-tensor kernels (fused AdamW, and foreach, torch's default on CUDA) take one list
of tensors and refuse DTensors mixed with plain tensors.

Mixture-of-experts blocks (sequence parallelism required): the router and the routed experts are
not split (torchtitan's ETP=1). Each tp rank routes the tokens of its own sequence shard
(``TokenLocal``: the input stays this rank's shard, the output is this rank's shard of the
residual), so no activation is gathered for them; their weights are replicated over tp and their
gradients, partial sums over the shards, are summed (``models.partial.partial_local``). Shared experts
are a dense feed-forward and split as one (colwise w1/w3, rowwise w2, the sequence gathered).
Expert parallelism may borrow the tp ranks (``parallel.expert``).

Qwen3's per-head q/k norms (``model.qk_norm``) are replicated over tp (``Replicated``): each rank
normalizes its own heads with the whole head_dim-sized weight, whose gradient from this rank's heads
is a partial sum that DTensor sums over tp (``models.llama.head_norm``).

Multi-head latent attention (``model.attention=mla``, models/mla.py): the up-projections wq (or
wq_b) and wkv_b are column-parallel (each rank computes its heads' queries, keys and values; a
head's channels are contiguous rows) and wo row-parallel, as for grouped-query attention. The
down-projections wq_a, wkv_a and their norms q_norm, kv_norm are replicated (``Replicated``): every
tp rank computes the latents of the whole (gathered) sequence, and their gradients, partial sums
over the ranks' heads, are summed by DTensor. They are small (rank x dim), so this costs a
latent-sized all-reduce in backward; the shared RoPE key leaves DTensor as this rank's heads'
partial gradient (``models.partial.partial_local``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle

from parallel3d.models.moe import MoE
from parallel3d.parallel.float8 import float8_block_plan


class ReplicateParallel(ParallelStyle):
    """A module every tp rank computes whole, on a replicated input (a norm without sequence
    parallelism): its parameters become replicated DTensors, its input one for the computation and
    its output a plain tensor again. Nothing is communicated: input, output and their gradients
    are the same on every tp rank, so the weight's gradient is too."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._input, self._output)

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for p_name, param in module.named_parameters(recurse=False):
            module.register_parameter(p_name, nn.Parameter(DTensor.from_local(param, mesh, [Replicate()],
                                                                              run_check=False)))

    @staticmethod
    def _input(module: nn.Module, inputs, mesh: DeviceMesh):
        x = inputs[0]
        return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def _output(module: nn.Module, output: DTensor, mesh: DeviceMesh):
        return output.to_local()


class EmbeddingDimSplit(ColwiseParallel):
    """ColwiseParallel (the embedding split over its dim) whose local output owns its memory.
    Under sequence parallelism each rank's slice of every token goes to the token's sequence
    shard by an all-to-all; gloo has none, and DTensor then gathers the whole sequence and keeps
    a view of this rank's part, which would keep the whole gathered tensor alive for as long as
    the first block saves its input (a pipeline holds it for every micro batch in flight)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        if isinstance(out, torch.Tensor) and out.untyped_storage().nbytes() > out.numel() * out.element_size():
            out = out.clone()
        return out


# The one table of tensor-parallel splits: for each layer, the dim of its weight that tp splits
# (0: output features, column-parallel; 1: input features, row-parallel; None: replicated). The
# plans below are built from it, and the planner (planner/layout.py) counts each rank's shard by it.
BLOCK_SPLITS = {
    "attention_norm": None,
    "attention.wq": 0,
    "attention.wk": 0,
    "attention.wv": 0,
    "attention.wo": 1,
    "ffn_norm": None,
    "feed_forward.w1": 0,
    "feed_forward.w2": 1,
    "feed_forward.w3": 0,
}
# The same for multi-head latent attention (see the module docstring); without q_lora_rank it has wq.
MLA_SPLITS = {
    "attention.wq": 0,
    "attention.wq_a": None,
    "attention.q_norm": None,
    "attention.wq_b": 0,
    "attention.wkv_a": None,
    "attention.kv_norm": None,
    "attention.wkv_b": 0,
    "attention.wo": 1,
}


def block_splits(attention: str, q_lora_rank: int) -> dict[str, int | None]:
    """``BLOCK_SPLITS`` for this attention: the dims tp splits of one block's layers."""
    if attention != "mla":
        return BLOCK_SPLITS
    ffn = {k: v for k, v in BLOCK_SPLITS.items() if not k.startswith("attention.")}
    dropped = ("attention.wq_a", "attention.q_norm", "attention.wq_b") if not q_lora_rank else ("attention.wq",)
    return {k: v for k, v in MLA_SPLITS.items() if k not in dropped} | ffn


class Replicated(ParallelStyle):
    """A layer every tp rank computes whole on a replicated DTensor input (MLA's down-projections
    and their norms): its parameters become replicated DTensors, input and output stay DTensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, ReplicateParallel._replicate_params)


class TokenLocal(ParallelStyle):
    """A module that computes on this rank's sequence shard with weights replicated over tp (a
    MoE's router and experts): parameters become replicated DTensors, which the module uses as
    local tensors with partial gradients; its Shard(1) input becomes this rank's plain shard and
    its output, a plain tensor, is this rank's shard of the residual. Submodules that have a plan
    of their own (``skip``) are left to it."""

    def __init__(self, skip: tuple[str, ...] = ()):
        super().__init__()
        self.skip = skip

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Not distribute_module: it would also replicate what is left to other plans, and buffers
        # (the sigmoid router's bias stays a plain tensor, equal on every rank).
        for name, sub in module.named_modules():
            if any(name == s or name.startswith(s + ".") for s in self.skip):
                continue
            for p_name, param in sub.named_parameters(recurse=False):
                if not isinstance(param, DTensor):
                    sub.register_parameter(p_name, nn.Parameter(
                        DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)))
        module.register_forward_pre_hook(
            lambda mod, inputs: tuple(x.to_local() if isinstance(x, DTensor) else x for x in inputs))
        return module


def moe_feed_forward_plan(moe: MoE) -> dict:
    """A MoE feed-forward under sequence parallelism (see the module docstring)."""
    plan = {"feed_forward": TokenLocal(skip=("shared",))}
    if moe.shared is not None:
        plan |= {"feed_forward.shared": PrepareModuleInput(input_layouts=(Shard(1),),
                                                           desired_input_layouts=(Replicate(),)),
                 "feed_forward.shared.w1": ColwiseParallel(), "feed_forward.shared.w3": ColwiseParallel(),
                 "feed_forward.shared.w2": RowwiseParallel(output_layouts=Shard(1))}
    return plan


def outer_splits(tied: bool) -> dict[str, int | None]:
    """The embedding, final norm and output projection's split dims (see ``outer_plan``): a tied
    embedding is the output projection too, split over the vocabulary; an untied one over its dim."""
    splits = {"tok_embeddings": 0 if tied else 1, "norm": None}
    return splits if tied else splits | {"output": 0}


def residual_layout(sequence_parallel: bool):
    """How the residual stream between blocks is laid out over the tp ranks."""
    return Shard(1) if sequence_parallel else Replicate()


def block_plan(sequence_parallel: bool, moe: MoE | None = None, splits: dict | None = None) -> dict:
    """A transformer block's plan; ``moe``: its feed-forward is that mixture of experts; ``splits``:
    its layers' (``block_splits``, default grouped-query attention's)."""
    residual = residual_layout(sequence_parallel)
    styles = {0: ColwiseParallel, 1: lambda: RowwiseParallel(output_layouts=residual), None: Replicated}
    plan = {name: styles[dim]() for name, dim in (splits or BLOCK_SPLITS).items()
            if name not in ("attention_norm", "ffn_norm")}  # set below: sequence parallel or replicated
    # attention and feed_forward take their input as one Replicate DTensor (gathered along the
    # sequence first under sequence parallelism; x of (x, cos, sin): the rotary tables are plain
    # tensors). Then the gradients that wq/wk/wv (w1/w3) return for it are summed as one Partial
    # DTensor and reduced once per module; given a plain tensor, each colwise layer would make a
    # DTensor of its own and all-reduce its own gradient (3 + 2 all-reduces per block, not 1 + 1).
    plan |= {
        "attention": PrepareModuleInput(input_layouts=(residual, None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
    }
    norm = SequenceParallel() if sequence_parallel else ReplicateParallel()
    plan |= {"attention_norm": norm, "ffn_norm": norm}
    if moe is not None:  # validation requires sequence parallelism: each rank routes its own tokens
        plan = {k: v for k, v in plan.items() if not k.startswith("feed_forward")} | moe_feed_forward_plan(moe)
    return plan


def outer_plan(sequence_parallel: bool, tied: bool) -> dict:
    residual = residual_layout(sequence_parallel)
    # A tied embedding is the output projection too, which must be split over the vocabulary
    # (loss parallel). An untied one is split over its embedding dim: DTensor's backward of a
    # vocabulary split builds the whole vocab x dim gradient on every rank before sharding it
    # (8 GiB of float32 for 405B), and its forward reduces a whole-width partial output, where the
    # dim split sends each rank's slice to its sequence shard (all-to-all) or gathers it.
    embedding = RowwiseParallel if tied else EmbeddingDimSplit
    plan = {"tok_embeddings": embedding(input_layouts=Replicate(), output_layouts=residual),
            "norm": SequenceParallel() if sequence_parallel else ReplicateParallel()}
    if not tied:
        plan["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          float8: bool = False) -> None:
    """Shard ``model``'s blocks (those this pipeline stage holds) and outer layers over ``tp_mesh``;
    ``float8``: the blocks hold float8 layers (parallel/float8.py), which take float8 styles."""
    tied = model.cfg.tie_embeddings
    present = {name for name, _ in model.named_children()}  # a pipeline stage lacks some (set to None)
    outer = {k: v for k, v in outer_plan(sequence_parallel, tied).items() if k in present}
    if outer:
        parallelize_module(model, tp_mesh, outer)
    if tied and "norm" in present:
        # The tied projection is F.linear with the embedding weight, which the embedding plan
        # already sharded over the vocabulary (Shard(0), as colwise would): give it the whole
        # sequence as a DTensor and DTensor returns vocab-sharded logits.
        parallelize_module(model.norm, tp_mesh, PrepareModuleOutput(
            output_layouts=residual_layout(sequence_parallel), desired_output_layouts=Replicate(),
            use_local_output=False))
    splits = block_splits(model.cfg.attention, model.cfg.q_lora_rank)
    head_norms = {"attention.q_norm": Replicated(), "attention.k_norm": Replicated()} if model.cfg.qk_norm else {}
    for block in model.layers.values():
        moe = block.feed_forward if isinstance(block.feed_forward, MoE) else None
        plan = block_plan(sequence_parallel, moe, splits) | head_norms
        parallelize_module(block, tp_mesh, float8_block_plan(block, plan) if float8 else plan)
