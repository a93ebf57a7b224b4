"""Muon (parallel3d/optim/muon.py): one process computes what torch.optim.Muon + torch.optim.AdamW do over
the same parameter split; every layout computes what one process does; a checkpoint with Muon's
momentum saved at one layout resumes at another; validation names bad optim.muon keys."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from harness.gloo_ranks import fork_gloo_ranks
from harness.parity import PARITY_STEPS, SAVE_EVERY, assert_matches
from omegaconf import OmegaConf
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.optim.muon import Muon, MuonWithAdamW, is_muon_parameter
from parallel3d.optim.schedule import lr_factor
from parallel3d.step import build_setup, train_step
from parallel3d.validate import check

# Newton–Schulz runs in bfloat16, slow on a CPU: a narrower tiny model keeps every run short.
MUON = ["optim=muon_cosine", "model.dim=64", "model.ffn_dim=128", "model.n_layers=2"]
MOE = ["model=tiny_moe", "model.moe.expert_ffn_dim=32"]
# The parity runs train at lr 1e-3, not muon_cosine's 3e-3. Newton–Schulz carries a gradient's last
# float32 bits into every element of the update, so Muon's one-process run is far more sensitive to
# round-off than AdamW's (tests/harness/tolerance.py measures it), and the more so the larger the
# steps: at 1e-3 the bound it implies for the losses is several times tighter than at 3e-3
# (docs/optimizers.md, "Parity").
PARITY = [*MUON, "optim.lr=1e-3"]

LAYOUTS = {  # name: (ranks, overrides); all in one 4-rank launch
    "muon-dp4-zero3": (4, ["parallel.zero_stage=3", "train.micro_batch_size=2"]),  # accumulating
    "muon-dp2-tp2": (4, ["parallel.tp=2", f"checkpoint.every={SAVE_EVERY}"]),  # saves the step a resume starts from
    "muon-dp2-pp2": (4, ["parallel.pp=2"]),
    # each expert on 2 ranks: split over ep, then its matrices sharded by FSDP over expert_dp
    "muon-ep2-dp4": (4, [*MOE, "parallel.ep=2", "parallel.zero_stage=3", "train.micro_batch_size=2"]),
}
SAVING = "muon-dp2-tp2"
# dp2 x pp2 resumes the dp2 x tp2 run's middle checkpoint: FSDP x tp shards of the momentum, read as FSDP x pp ones.
RESUMED = ("muon-resumed-dp2-pp2", (4, ["parallel.pp=2"]))


@pytest.fixture
def one_thread():
    """bfloat16 matmuls on a shared CPU: torch's threads fight each other (and other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _setup(overrides: list[str]):
    # No clipping: a clipped gradient (ours in float64, torch's in float32) would differ in its
    # last bits, and Newton–Schulz's bfloat16 rounding would make that a visible weight difference.
    cfg = check(compose(["train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=16",
                         "train.steps=10", "optim.warmup_steps=2", "train.grad_clip=0", "run_dir=/nonexistent",
                         *MUON, *overrides]), 1)
    return build_setup(OmegaConf.to_object(cfg), torch.device("cpu"))


def _batches(step: int, vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randint(0, vocab, (2, 16), generator=g), torch.randint(0, vocab, (2, 16), generator=g))
            for _ in range(2)]


class ByHand:
    """torch.optim.Muon over the block matrices, one leaf per expert's matrix, and torch.optim.AdamW
    over the rest (no decay for norms), one LambdaLR each, driving ``model`` as train_step would."""

    def __init__(self, model: torch.nn.Module, o, steps: int):
        named = list(model.named_parameters())
        self.stacks = [p for name, p in named if p.ndim == 3]  # the experts: (E, out, in)
        self.experts = [[torch.nn.Parameter(m.detach().clone()) for m in p] for p in self.stacks]
        matrices = [p for name, p in named if p.ndim == 2 and name.startswith("layers.") and "router" not in name]
        muon = [*matrices, *(leaf for leaves in self.experts for leaf in leaves)]
        rest = [(name, p) for name, p in named if not any(p is q for q in [*matrices, *self.stacks])]
        self.muon = torch.optim.Muon(muon, lr=o.lr, weight_decay=o.weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(
            [{"params": [p for name, p in rest if "norm" not in name], "weight_decay": o.weight_decay},
             {"params": [p for name, p in rest if "norm" in name], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)  # as optim.implementation=auto on a CPU
        factor = partial(lr_factor, steps=steps, warmup=o.warmup_steps, schedule=o.schedule,
                         min_ratio=o.min_lr_ratio, decay_fraction=o.decay_fraction)
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(opt, factor) for opt in (self.muon, self.adamw)]
        self.params = [p for _, p in named]

    @torch.no_grad()
    def step(self) -> None:
        for stack, leaves in zip(self.stacks, self.experts):
            for leaf, grad in zip(leaves, stack.grad):
                leaf.grad = grad.clone()
        self.muon.step()
        self.adamw.step()
        for stack, leaves in zip(self.stacks, self.experts):
            stack.copy_(torch.stack([leaf.detach() for leaf in leaves]))
        for schedule in self.schedules:
            schedule.step()
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("model", [[], MOE], ids=["dense", "moe"])
def test_one_process_equals_torch_muon_and_adamw_by_hand(model, one_thread):
    ours, theirs = _setup(model), _setup(model)
    assert isinstance(ours.optimizer, MuonWithAdamW)
    by_hand = ByHand(theirs.model, theirs.config.optim, steps=10)
    vocab = ours.config.model.vocab_size
    for step in range(10):
        batches = _batches(step, vocab)
        loss = train_step(ours, batches).loss_sum
        ours.optimizer.zero_grad(set_to_none=True)
        their_loss = sum(theirs.loss_fn(theirs.model(x), y) for x, y in batches)
        their_loss.backward()
        by_hand.step()
        assert abs(loss.item() - their_loss.item()) <= 1e-5 * abs(their_loss.item()), step
    torch.testing.assert_close(dict(ours.model.state_dict()), dict(theirs.model.state_dict()), rtol=0, atol=0)


def test_a_skipped_step_moves_neither_weights_nor_momentum(one_thread):
    """The bad-step guard skips the one optimizer: Muon's matrices and momentum stay as they were."""
    from parallel3d.runtime.guard import BadStepGuard

    setup = _setup([])
    guard = BadStepGuard(on_bad_step="skip", spike_factor=0.0, max_bad_steps=3, nan_steps=[2])
    wq = setup.model.layers["0"].attention.wq.weight
    for step in (1, 2):
        guard.begin(step)
        train_step(setup, _batches(step, setup.config.model.vocab_size), guard=guard)
        setup.optimizer.zero_grad(set_to_none=True)
        if step == 1:
            before = wq.detach().clone(), setup.optimizer.state[wq]["momentum_buffer"].clone()
    assert guard.skipped and guard.skipped_steps == 1
    torch.testing.assert_close((wq.detach(), setup.optimizer.state[wq]["momentum_buffer"]), before, rtol=0, atol=0)


@pytest.mark.fast
def test_the_parameter_rule():
    """Block matrices and stacked experts: Muon's; embedding, head, norms and routers: AdamW's."""
    setup = _setup(MOE)
    muon = {name for name, p in setup.model.named_parameters() if is_muon_parameter(name, p.ndim)}
    assert muon == {f"layers.{i}.{n}" for i in range(2) for n in
                    ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                     "feed_forward.experts.w1", "feed_forward.experts.w2", "feed_forward.experts.w3")}
    assert [len(g["params"]) for g in setup.optimizer.param_groups] == [len(muon), 4, 5]  # muon, decay, norms


@pytest.mark.parametrize("override, key", [
    ("optim.name=sgd", "optim.name"),
    ("optim.muon.adjust_lr_fn=none", "optim.muon.adjust_lr_fn"),
    ("optim.muon.ns_coefficients=[1.0,2.0]", "optim.muon.ns_coefficients"),
    ("optim.muon.momentum=1.0", "optim.muon.momentum"),
])
def test_bad_muon_keys_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check(compose([*MUON, override, "run_dir=."]), 1)


# (shape, placement over 2 ranks): FSDP's and tp's splits of a matrix (uneven ones too, one that
# leaves a rank nothing, and FSDP's strided split of a tp split), and stacked experts split along the expert dim (ep, FSDP:
# orthogonalised where they lie) or, as a check, along a matrix dim (each expert shared out).
SPLITS = [((63, 48), Shard(0)), ((48, 64), Shard(1)), ((64, 32), _StridedShard(0, split_factor=2)),
          ((96, 40), Shard(0)), ((1, 40), Shard(0)), ((4, 24, 16), Shard(0)), ((4, 24, 16), Shard(2))]


def _update_on_two_ranks(rank: int) -> None:
    """One Muon over every split steps as one process does on the whole tensors, bit for bit, and
    each rank runs Newton–Schulz only on its share of the split matrices."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel3d.optim import muon as muon_module
    from parallel3d.optim.orthogonalise import owners

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, eps=1e-7, ns_steps=5,
                    ns_coefficients=(3.4445, -4.775, 2.0315), adjust_lr_fn="original")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=g) for shape, _ in SPLITS]
    grads = [[torch.randn(shape, generator=g) for shape, _ in SPLITS] for _ in range(2)]
    whole = [torch.nn.Parameter(w.clone()) for w in weights]
    split = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [pl])) for w, (_, pl) in zip(weights, SPLITS)]
    one, two = Muon(whole, **settings), Muon(split, **settings)
    calls, orthogonalise = [], muon_module.newton_schulz

    def counted(matrix: torch.Tensor, *args) -> torch.Tensor:
        calls.append(tuple(matrix.shape))
        return orthogonalise(matrix, *args)

    muon_module.newton_schulz = counted  # this forked process's own copy of the module
    for step_grads in grads:
        for w, s, grad, (_, pl) in zip(whole, split, step_grads, SPLITS):
            w.grad, s.grad = grad.clone(), distribute_tensor(grad.clone(), mesh, [pl])
        one.step()
        calls.clear()
        two.step()
    for s, w, (shape, pl) in zip(split, whole, SPLITS):
        assert torch.equal(s.full_tensor(), w.detach()), (shape, pl)
    shared = [shape[-2:] for shape, pl in SPLITS for _ in range(shape[0] if len(shape) == 3 else 1)
              if pl.dim >= len(shape) - 2]  # matrices in pieces: each orthogonalised by its owner
    mine = sorted(s for s, owner in zip(shared, owners(shared, 2)) if owner == rank)
    local = [shape[-2:] for shape, pl in SPLITS if len(shape) == 3 and pl.dim == 0 for _ in range(shape[0] // 2)]
    assert sorted(calls) == sorted([*mine, *local]) and 0 < len(mine) < len(shared), (rank, calls)


@pytest.mark.multirank
def test_a_split_matrix_gets_the_update_of_the_whole():
    fork_gloo_ranks(_update_on_two_ranks)


@pytest.mark.parametrize("world, overrides", [
    (4, ["parallel.tp=2"]),  # FSDP x tp: one group of 4 holders, FSDP's strided split of tp's
    (3, ["parallel.zero_stage=3", "train.global_batch_size=12"]),  # 14 matrices: 3 owners' shares differ
])
def test_the_planner_counts_the_exchange_the_dry_run_measures(world, overrides):
    """Muon's all-to-alls (the only ones of a dense model): by group, the bytes the planner counts
    for the busiest holder are the most any rank sends in the dry run; the step-time estimate
    counts them as exposed."""
    from parallel3d.planner import predict
    from parallel3d.planner.plan import Hardware
    from parallel3d.planner.dryrun import dry_run

    overrides = [*MUON, *overrides]
    measured: dict[str, float] = {}
    for report in dry_run(overrides, world, list(range(world))):
        for group, kinds in report.comm.items():
            if "all_to_all" in kinds:
                measured[group] = max(measured.get(group, 0.0), kinds["all_to_all"].sent_bytes)
    plan = predict(compose([*overrides, "run_dir=/nonexistent"]), world, Hardware())
    planned = {group: kinds["all_to_all"] for group, kinds in plan.comm_bytes.items() if "all_to_all" in kinds}
    assert measured and measured == planned
    assert plan.step_time.exposed_comm_s >= sum(planned.values()) / Hardware().intra_node_bw


def saved_checkpoint(parity) -> Path:
    """The dp2 x tp2 run's step-5 checkpoint, where that run is (or will be: the resume trains after
    it in one launch)."""
    nproc, overrides = LAYOUTS[SAVING]
    return parity.run_dir(SAVING, nproc, [*PARITY, *overrides]) / "checkpoints" / f"step_{SAVE_EVERY}"


@pytest.fixture(scope="module")
def muon_runs(parity):
    """The one-process references (dense, MoE) and their twins in one launch; the layouts, then the
    resume, in one 4-rank launch (the resume reads the checkpoint the dp2 x tp2 run wrote before it)."""
    saved = saved_checkpoint(parity)
    parity.prefetch_references(dict(REFERENCES.values()))
    resumed_name, (n, resumed) = RESUMED
    parity.prefetch({**{name: (n, [*PARITY, *o]) for name, (n, o) in LAYOUTS.items()},
                     resumed_name: (n, [*PARITY, *resumed, f"checkpoint.resume={saved}"])})
    return parity


REFERENCES = {  # dense or MoE: the one-process run (name, overrides); each trains with its twins
    False: ("muon-reference", [*PARITY, "train.micro_batch_size=16"]),
    True: ("muon-moe-reference", [*PARITY, *MOE, "train.micro_batch_size=16"]),
}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(muon_runs, name):
    """Losses, grad norms and final weights of one process, within what its own sensitivity
    implies (tests/harness/tolerance.py). Layouts sum gradients in other float32 orders, and
    Newton–Schulz, which raises a matrix's small singular values by up to a^ns_steps (about 480),
    carries those last bits into every element of the update (docs/optimizers.md): the weights'
    bound is wide. test_a_split_matrix_gets_the_update_of_the_whole shows the split update equal
    to the whole one, bit for bit, given the same gradient."""
    nproc, overrides = LAYOUTS[name]
    reference, tolerance = muon_runs.measured(*REFERENCES[MOE[0] in overrides])
    run = muon_runs.run(name, nproc, [*PARITY, *overrides])
    assert_matches(reference, run, tolerance=tolerance, metrics=("loss", "grad_norm"), weights=True)


@pytest.mark.multirank
def test_muon_state_saved_at_dp2_tp2_resumes_at_dp2_pp2(muon_runs):
    reference, tolerance = muon_runs.measured(*REFERENCES[False])
    name, (nproc, overrides) = RESUMED
    saved = saved_checkpoint(muon_runs)
    run = muon_runs.run(name, nproc, [*PARITY, *overrides, f"checkpoint.resume={saved}"])
    assert [r["step"] for r in run.metrics] == list(range(SAVE_EVERY + 1, PARITY_STEPS + 1))
    assert_matches(reference, run, tolerance=tolerance, metrics=("loss", "grad_norm"), weights=True)
