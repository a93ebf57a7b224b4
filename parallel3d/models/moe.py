"""Mixture of experts: a router picks ``top_k`` of ``num_experts`` SwiGLU experts per token.

Dropless by default: every token reaches every expert it picked, so the result does not depend on
how tokens are batched, split over ranks or micro batches (layout invariance, as for dense blocks).
A ``capacity_factor`` caps each expert's token copies per forward (``MoE.assign``).
Tokens are sorted by expert and each expert multiplies its contiguous rows: one grouped matmul
(``torch._grouped_mm``) on a GPU that has it, a loop over experts elsewhere (the same sums).

Where the sorted tokens are computed is the ``dispatch``'s business: here, on this rank; under
expert parallelism (``parallel3d.parallel.expert``) an all-to-all sends them to the rank holding
their expert and brings the results back.

Token-local: under context parallelism and under tensor parallelism's sequence split, each rank
routes the tokens of its own piece of every sequence (``sequence_group``: the cp x tp ranks that
split a sequence). Router and experts are then replicated over tp (DTensors on the tp mesh that
forward uses as local tensors, see ``models.partial.partial_local``), and their gradients are partial sums over
those ranks' tokens, which the data-parallel wrapper (or ``optim.settle_gradients``) adds up.

Load balancing:
* ``aux_loss_coef``: a sequence-wise balance loss (DeepSeek-V3 eq. 17-20), ``E/(K*S) * sum_i
  count_i * mean_prob_i`` per sequence, averaged over the step's sequences. Computed per sequence it
  is the same in every layout (a batch-wide loss would depend on the micro batch). It joins the
  training loss through its gradient (``AuxLossGradient``), so no schedule or loss function needs to
  know about it; metrics report it as ``aux_loss``. When ranks split each sequence, they add up
  each sequence's expert counts first (one small all-reduce over ``sequence_group`` per block and
  micro batch), so every rank's part is exact and the parts sum to one process's loss.
* ``router=sigmoid``: DeepSeek-V3's aux-loss-free balancing: a per-expert bias, added to the scores
  for choosing experts only, moves by ``bias_update_rate`` after each step towards even load.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from parallel3d.config.schema import ModelConfig, MoEConfig
from parallel3d.models.partial import partial_local


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Blocks every-1, 2*every-1, ... are MoE (``every=1``: all; ``every=2``: the odd ones), except
    the first ``first_dense_layers``."""
    moe = cfg.moe
    return moe.num_experts > 0 and (layer + 1) % moe.every == 0 and layer >= moe.first_dense_layers


def expert_hidden(cfg: ModelConfig) -> int:
    return cfg.moe.expert_ffn_dim or cfg.ffn_dim


class Router(nn.Module):
    def __init__(self, dim: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.num_experts, bias=False)
        # Selection bias of the sigmoid router, a buffer: trained by load, not by gradients.
        self.register_buffer("expert_bias", torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(n, d) tokens -> routing weights (n, k), chosen experts (n, k), scores (n, E) summing to 1."""
        logits = F.linear(x, partial_local(self.gate.weight)).float()
        if self.moe.router == "softmax":
            scores = logits.softmax(dim=-1)
            weights, chosen = scores.topk(self.moe.top_k, dim=-1)
        else:
            affinity = logits.sigmoid()
            chosen = self.limit_groups(affinity + self.expert_bias).topk(self.moe.top_k, dim=-1).indices
            weights = affinity.gather(-1, chosen)
            scores = affinity / affinity.sum(dim=-1, keepdim=True)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.moe.routed_scaling_factor, chosen, scores

    def limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's group-limited routing: experts come in ``n_group`` groups, a group scores
        the sum of its best two choice scores, and a token may pick from its ``topk_group`` best
        groups only (the others' scores become -inf)."""
        n_group = self.moe.n_group
        if n_group == 1:
            return choice
        grouped = choice.view(-1, n_group, self.moe.num_experts // n_group)
        best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.moe.topk_group, dim=-1).indices
        allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view_as(choice)


class ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (expert weights under expert
    parallelism receive the gradients of ep ranks' tokens: see ``parallel.expert``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as three stacked weights (experts first, Hugging Face's
    (out, in) orientation per expert): w1, w3 (E, H, D), w2 (E, D, H)."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.grad_scale = 1.0

    def local_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's experts (all of them without expert parallelism), in the compute dtype: the
        data-parallel wrapper's cast, or this one where it leaves them alone (expert parallelism
        with no other rank holding the same experts, ``parallel.data.ExpertSharding``)."""
        out = [partial_local(w).to(dtype) for w in (self.w1, self.w2, self.w3)]
        if self.grad_scale != 1.0:
            out = [ScaleGradient.apply(w, self.grad_scale) for w in out]
        return out[0], out[1], out[2]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` sorted by expert, ``counts[e]`` of them for local expert e."""
        w1, w2, w3 = self.local_weights(x.dtype)
        if _grouped_mm_applies(x, w1):
            offsets = counts.cumsum(0).to(torch.int32)
            hidden = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            hidden = hidden * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(hidden, w2.transpose(-2, -1), offs=offsets)
        outputs = []
        for e, rows in enumerate(torch.split(x, split_sizes(counts, x.shape[0]))):
            outputs.append(F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e]))
        return torch.cat(outputs) if outputs else x.new_zeros(0, w2.shape[1])


def split_sizes(counts: torch.Tensor, total: int) -> list[int]:
    """``counts`` as Python ints. Under the dry run's FakeTensorMode routing has no values: take it
    balanced (``total`` rows spread evenly), the case the planner assumes too."""
    if is_fake(counts):
        n = counts.numel()
        return [total // n + (i < total % n) for i in range(n)]
    return counts.tolist()


def _grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm: CUDA, bfloat16, dims that are multiples of 16 (its kernel's alignment)."""
    return (x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == w.dtype == torch.bfloat16
            and x.shape[-1] % 16 == 0 and w.shape[1] % 16 == 0)


def local_dispatch(x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
    """Compute the expert-sorted tokens here (every expert is on this rank)."""
    return experts(x, counts)


class AuxLossGradient(torch.autograd.Function):
    """Returns ``out`` unchanged and gives ``aux`` the gradient 1 in backward: the aux loss
    joins the training loss wherever (and on whichever pipeline stage) the LM loss is computed."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class MoE(nn.Module):
    """The feed-forward of a MoE block: routed experts plus optional shared experts."""

    def __init__(self, cfg: ModelConfig, shared: Optional[nn.Module] = None):
        super().__init__()
        self.moe = cfg.moe
        self.router = Router(cfg.dim, cfg.moe)
        self.experts = GroupedExperts(cfg.moe.num_experts, cfg.dim, expert_hidden(cfg))
        self.shared = shared
        self.dispatch: Callable[[torch.Tensor, torch.Tensor, GroupedExperts], torch.Tensor] = local_dispatch
        # Set by the trainer (``parallel.expert.configure_moe``): the sequences one data-parallel
        # rank trains on per step (the aux loss is a mean over the step's sequences); the ranks
        # that split each sequence (cp x tp, None: this rank holds whole sequences); and the
        # factor on the aux loss's gradient that undoes the gradient average over cp ranks, which
        # hold parts of one data-parallel rank's sequences, not sequences of their own.
        self.sequences_per_step = 1
        self.sequence_group = None
        self.sequence_split = 1
        self.aux_grad_scale = 1.0
        self.reset_stats()

    def reset_stats(self) -> None:
        """(tokens per expert, aux loss, copies dropped) of each training forward since the last step, on the host."""
        self.forward_stats: list[tuple[torch.Tensor, torch.Tensor, float]] = []

    def step_stats(self, forwards: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens per expert and aux loss summed over the step's last ``forwards`` forwards (the
        step's micro batches): in its first step torch's pipeline stage runs one more forward
        first, on empty tensors, to infer shapes."""
        kept = self.forward_stats[-forwards:]
        tokens = sum((t for t, _, _ in kept), torch.zeros(self.moe.num_experts, dtype=torch.float64))
        return tokens, sum((a for _, a, _ in kept), torch.zeros((), dtype=torch.float64))

    def step_dropped(self, forwards: int) -> float:
        """Token copies dropped for capacity over the step's last ``forwards`` forwards."""
        return sum(d for _, _, d in self.forward_stats[-forwards:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, chosen, scores = self.router(flat)
        order, counts, dropped = self.assign(chosen, weights)
        token = order // self.moe.top_k
        routed = self.dispatch(flat[token], counts, self.experts)
        routed = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, routed)
        out = out.view(batch, seq, dim)
        if self.shared is not None:  # (b, s, d): tensor parallelism splits it as a dense feed-forward
            out = out + self.shared(x)
        # Only where it is trained: evaluation and the pipeline's shape inference skip its all-reduce.
        aux = None
        if self.moe.aux_loss_coef > 0 and torch.is_grad_enabled():
            aux = self.balance_loss(chosen, scores, batch, seq)
        # Count training forwards once: not evaluation or the pipeline's shape inference (no grad),
        # not activation checkpointing's replay of forward in backward.
        if torch.is_grad_enabled() and not _recomputing() and not is_fake(counts):
            aux_value = torch.zeros((), dtype=torch.float64) if aux is None else aux.detach().to("cpu", torch.float64)
            self.forward_stats.append((counts.detach().to("cpu", torch.float64), aux_value, float(dropped)))
        if aux is not None:
            out = AuxLossGradient.apply(out, aux * self.aux_grad_scale)
        return out

    def assign(self, chosen: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token copies (indices into ``chosen.flatten()``) that reach an expert, sorted by expert
        (stable: token order within an expert), tokens per expert, and the copies dropped for capacity."""
        experts = chosen.flatten()
        # (scatter_add, not bincount: its output's shape is static, which fake tensors need)
        counts = torch.zeros(self.moe.num_experts, dtype=torch.long, device=chosen.device).scatter_add_(
            0, experts, torch.ones_like(experts))
        capacity = math.ceil(self.moe.capacity_factor * chosen.numel() / self.moe.num_experts)
        # Dropless, and the dry run's routing, which has no values (the planner's upper bound).
        if self.moe.capacity_factor <= 0 or is_fake(chosen) or int(counts.max()) <= capacity:
            return experts.argsort(stable=True), counts, torch.zeros((), dtype=torch.long)
        keep = within_capacity(experts, weights.flatten(), counts, capacity)
        kept = keep.nonzero().squeeze(1)
        order = kept[experts[kept].argsort(stable=True)]
        return order, counts.clamp(max=capacity), (~keep).sum()

    def balance_loss(self, chosen: torch.Tensor, scores: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """Sequence-wise balance loss of this micro batch, weighted by ``aux_loss_coef`` and
        divided by the rank's sequences per step (its share of the step's mean). When ranks split
        each sequence, the loss is bilinear in (counts, scores) summed over the whole sequence: the
        counts (no gradient) are summed over the ranks first, the scores stay local, so each rank
        returns its tokens' part, with its tokens' gradient, and the parts add up to the loss."""
        E, K = self.moe.num_experts, self.moe.top_k
        picked = F.one_hot(chosen.view(batch, seq * K), E).sum(dim=1).float()  # (batch, E)
        if self.sequence_group is not None:
            dist.all_reduce(picked, group=self.sequence_group)
        whole = seq * self.sequence_split  # tokens of a whole sequence
        load = picked * (E / (K * whole))
        score_share = scores.view(batch, seq, E).sum(dim=1) / whole  # this rank's part of the mean score
        per_sequence = (load * score_share).sum(dim=-1)
        return self.moe.aux_loss_coef * per_sequence.sum() / self.sequences_per_step


def within_capacity(experts: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which token copies an expert keeps when it may take ``capacity`` of them: those with the
    highest routing weight (ties: the earlier token), as Megatron's ``drop_policy=probs``."""
    by_weight = weights.argsort(descending=True, stable=True)
    ranked = by_weight[experts[by_weight].argsort(stable=True)]  # by expert, then weight
    starts = counts.cumsum(0) - counts
    position = torch.arange(experts.numel(), device=experts.device) - starts[experts[ranked]]
    return torch.zeros_like(experts, dtype=torch.bool).index_fill_(0, ranked[position < capacity], True)


def _recomputing() -> bool:
    """True while autograd runs a backward pass (a checkpointed forward being replayed)."""
    return torch._C._current_graph_task_id() != -1


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """This model's (or pipeline stage's) MoE feed-forwards by block name."""
    return {name: block.feed_forward for name, block in model.layers.items() if isinstance(block.feed_forward, MoE)}


def active_ffn_params(cfg: ModelConfig) -> int:
    """Feed-forward matmul weights a token passes through in one MoE block (router included)."""
    per_expert = 3 * cfg.dim * expert_hidden(cfg)
    return (cfg.moe.top_k + cfg.moe.shared_experts) * per_expert + cfg.dim * cfg.moe.num_experts
