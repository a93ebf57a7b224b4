"""Expert parallelism (parallel3d/parallel/expert.py): every layout trains the tiny MoE to the
losses, gradient norms, aux losses, expert loads and final weights of one process; the planner's
model-state bytes are exact (``Parity.run``); validation refuses what is not supported. ep2 x tp2
and ep2 x cp2 borrow the tp and cp ranks for ep (parallel/expert.py)."""

from __future__ import annotations

import pytest
from harness.parity import PARITY_STEPS, Matrix, assert_matches, layouts, prefetch_selected
from harness.runs import FAST, final_weights, launch, relative_error
from harness.tolerance import ONE_PASS

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.validate import check

MOE = ["model=tiny_moe"]

# FAST's micro batch (4) is a dp4 rank's whole batch: these accumulate 2 micro batches of 2 as the
# ZeRO stages do with experts sharded over expert_dp.
ACCUMULATE = ["train.micro_batch_size=2"]
LAYOUTS = layouts({  # name: (ranks, overrides)
    "ep2-dp2-zero3": (2, ["parallel.ep=2", "parallel.zero_stage=3"]),
    "ep4-dp4-zero3": (4, ["parallel.ep=4", "parallel.zero_stage=3", *ACCUMULATE]),
    # dp4: each expert on 2 ranks (expert_dp), the experts' own units shard or replicate them there
    "ep2-dp4-zero0": (4, ["parallel.ep=2", "parallel.zero_stage=0", *ACCUMULATE]),
    "ep2-dp4-zero1": (4, ["parallel.ep=2", "parallel.zero_stage=1", *ACCUMULATE]),
    "ep2-dp4-zero2": (4, ["parallel.ep=2", "parallel.zero_stage=2", "checkpoint.every=2", *ACCUMULATE]),  # + resharding
    "ep2-dp2-pp2": (4, ["parallel.ep=2", "parallel.pp=2", "parallel.zero_stage=3"]),
    "ep2-dp4-pp2": (8, ["parallel.ep=2", "parallel.pp=2", "parallel.zero_stage=3", *ACCUMULATE]),  # expert units in stages
    # ep borrows the tp ranks: each routes its sequence shard; router replicated over tp (dp2)
    "ep2-tp2-dp2-zero3": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.zero_stage=3", "train.micro_batch_size=8"]),
    # ep borrows the cp ranks: the aux loss adds up each sequence's counts over cp (dp2)
    "ep2-cp2-dp2-zero3": (4, ["parallel.ep=2", "parallel.cp=2", "parallel.zero_stage=3", "train.micro_batch_size=8"]),
})
MATRIX = Matrix(tuple(LAYOUTS), prefix="moe-", extra=tuple(MOE))  # lent to other files' batches (harness/parity.py)
SAVING = next(layout for layout in LAYOUTS if layout.name == "ep2-dp4-zero2")  # saves every 4 steps


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py)."""
    prefetch_selected(request, parity, MATRIX)


REFERENCE = ("moe-reference", [*MOE, "train.micro_batch_size=16"])  # one process (and its twins)


@pytest.fixture(scope="module")
def moe_reference(parity):
    return parity.measured(*REFERENCE)[0]


@pytest.fixture(scope="module")
def moe_tolerance(parity):
    """What the one-process run's own sensitivity implies (tests/harness/tolerance.py). A routing
    choice is a threshold: a token whose top experts sit at a near-tie could go either way under
    round-off and part the runs; the seed and lr here route no token that close (docs/moe.md)."""
    return parity.measured(*REFERENCE)[1]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_expert_parallel_layout_trains_like_one_process(parity, moe_reference, moe_tolerance, layout):
    run = parity.train(layout, prefix="moe-", extra=MOE)
    ref = moe_reference.metrics
    assert_matches(moe_reference, run, tolerance=moe_tolerance, metrics=("loss", "grad_norm", "aux_loss"), weights=True)
    assert run.metrics[0]["expert_load"] == ref[0]["expert_load"]  # the same routing, counted globally
    tokens = 16 * 64 * 2 * 4  # sequences x length x top_k x MoE blocks
    assert all(sum(r["expert_load"]) == tokens for r in run.metrics)
    assert all(r["expert_load_max_over_mean"] >= 1 for r in run.metrics)
    weights = final_weights(run.run_dir)  # Hugging Face names: Mixtral's, one tensor per expert
    assert [weights[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"].shape for e in range(8)] == [
        (64, 128)] * 8  # gathered whole


@pytest.mark.parametrize("overrides,world,key", [
    (["parallel.ep=2"], 2, "parallel.ep"),  # a dense model has no experts
    ([*MOE, "parallel.ep=3"], 3, "parallel.ep"),  # 8 experts
    ([*MOE, "parallel.ep=4", "parallel.dp_shard=2", "parallel.pp=2"], 4, "parallel.ep"),  # ep > dp_shard
    ([*MOE, "parallel.tp=2", "parallel.sequence_parallel=false"], 2, "parallel.sequence_parallel"),
    ([*MOE, "parallel.ep=4", "parallel.tp=2", "parallel.dp_shard=1"], 2, "parallel.ep"),  # ep > dp_shard x cp x tp
    ([*MOE, "model.moe.top_k=9"], 1, "model.moe.top_k"),
    ([*MOE, "model.moe.router=topk"], 1, "model.moe.router"),
    ([*MOE, "model.moe.capacity_factor=-1"], 1, "model.moe.capacity_factor"),
])
def test_validation_names_the_key(overrides, world, key):
    cfg = compose(overrides)
    with pytest.raises(ConfigError) as err:
        check(cfg, world)
    assert str(err.value).startswith(key) and "Fix:" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.multirank
def test_checkpoints_reshard_ep2_to_ep4_to_one_process(parity, moe_tolerance):
    """ep2 x dp4 (experts sharded over 2 expert-dp ranks too) saves at step 2; ep4 resumes there and
    saves at 4; one process resumes from that: every step after a resume and the final weights are
    those of the uninterrupted ep2 run, within the family's tolerance (each leg is a layout)."""
    source = parity.train(SAVING, prefix="moe-", extra=MOE)  # the parity run, saving every 2
    steps = f"train.steps={PARITY_STEPS}"
    ep4 = launch(parity.root / "moe-resumed-ep4", [*FAST, steps, *MOE, "parallel.ep=4", "checkpoint.every=2",
                 f"checkpoint.resume={source.run_dir / 'checkpoints' / 'step_2'}"], nproc=4)
    ep4.assert_finished(PARITY_STEPS)
    single = launch(parity.root / "moe-resumed-single", [*FAST, steps, *MOE, "train.save_model=true",
                    f"checkpoint.resume={ep4.run_dir / 'checkpoints' / 'step_4'}"])
    single.assert_finished(PARITY_STEPS)
    assert [r["step"] for r in ep4.metrics] == list(range(3, PARITY_STEPS + 1))
    assert [r["step"] for r in single.metrics] == list(range(5, PARITY_STEPS + 1))
    assert_matches(source, ep4, tolerance=moe_tolerance, metrics=("loss", "aux_loss"))
    assert_matches(source, single, tolerance=moe_tolerance, metrics=("loss", "aux_loss"), weights=True)


@pytest.mark.multirank
def test_capacity_drops_the_same_copies_in_every_layout(parity):
    """A capacity holds per forward on one rank (its micro batch's tokens): ep2 x dp2, with the
    micro batches of one process, drops the same copies in the first step and computes the same
    loss and gradient. Later steps are not compared: a drop is a threshold on routing weights, and
    the layouts' float32 round-off (1e-7) flips copies that sit at it (from step 2 on, one copy's
    gradient may differ), as in any framework with a capacity factor (docs/moe.md). A first step is
    one pass from the same weights: held to ONE_PASS (tests/harness/tolerance.py)."""
    capacity = [*MOE, "model.moe.capacity_factor=1.0"]
    single = parity.run("moe-capacity-single", 1, capacity)
    ep = parity.run("moe-capacity-ep2-dp2", 2, [*capacity, "parallel.ep=2", "parallel.zero_stage=3"])
    tokens = 16 * 64 * 2 * 4  # sequences x length x top_k x MoE blocks
    for run in (single, ep):
        assert all(r["expert_dropped"] > 0 and sum(r["expert_load"]) + r["expert_dropped"] == tokens
                   for r in run.metrics)
        assert run.losses[-1] < run.losses[0] - 1
    first, reference = ep.metrics[0], single.metrics[0]
    assert (first["expert_dropped"], first["expert_load"]) == (reference["expert_dropped"], reference["expert_load"])
    for key in ("loss", "grad_norm", "aux_loss"):
        assert relative_error([first[key]], [reference[key]]) <= ONE_PASS, key


def test_planner_counts_expert_traffic():
    """ep2 x dp2, tiny_moe: per micro batch (4 per rank) and MoE block (4), 2x64 tokens x top 2 copies
    of 128 float32 values, half of them to the other rank, 4 times (dispatch and combine, forward and
    backward); the dense weights' FSDP units leave the experts out; an expert_dp group (the experts'
    own units) only when dp > ep."""
    from parallel3d.planner import predict

    cfg = compose([*FAST, *MOE, "parallel.ep=2", "parallel.zero_stage=3", "train.micro_batch_size=2"])
    check(cfg, 2)
    comm = predict(cfg, 2).comm_bytes
    # + each forward's exchange of counts per expert: 8 int64
    assert comm["ep"] == {"all_to_all": 4 * 4 * (4 * (2 * 64 * 2 * 128 * 4) + 8 * 8) / 2}
    assert "expert_dp" not in comm
    dense_cfg = compose([*FAST, *MOE, "parallel.zero_stage=3", "train.micro_batch_size=2"])
    check(dense_cfg, 2)
    experts = 4 * 3 * 8 * 64 * 128  # MoE blocks x (w1 w2 w3) x experts x hidden x dim
    gathered = predict(dense_cfg, 2).comm_bytes["dp_shard"]["all_gather"] - comm["dp_shard"]["all_gather"]
    assert gathered == (4 + 4) * experts * 4 / 2  # ZeRO-3: gathered in forward and backward, 4 micro batches
    wider = compose([*FAST, *MOE, "parallel.ep=2", "parallel.zero_stage=3", "train.micro_batch_size=2"])
    check(wider, 4)  # dp4: each rank's 4 experts sharded over 2 expert-dp ranks, 2 micro batches, float32
    local = experts // 2 * 4  # bytes of one ep rank's experts
    assert predict(wider, 4).comm_bytes["expert_dp"] == {"all_gather": (2 + 2) * local / 2,  # forward, backward
                                                         "reduce_scatter": 2 * local / 2}
    replicated = compose([*FAST, *MOE, "parallel.ep=2", "parallel.zero_stage=0", "train.micro_batch_size=2"])
    check(replicated, 4)  # ZeRO-0: the experts' gradients all-reduced over their 2 copies once per step
    assert predict(replicated, 4).comm_bytes["expert_dp"] == {"all_reduce": 2 * local / 2}


def test_dry_run_sends_the_planned_all_to_all_bytes():
    """The dry run (fake tensors: routing taken balanced, as the planner takes it) through ep2 x pp2:
    the all-to-all bytes rank 0 sends are the planner's, the routing counts' exchange included (8
    experts x int64 per MoE block and micro batch, forward only, half of it to the other rank)."""
    from parallel3d.planner import predict
    from parallel3d.planner.dryrun import dry_run

    overrides = [*FAST, *MOE, "parallel.ep=2", "parallel.pp=2", "run_dir=/nonexistent"]
    [report] = dry_run(overrides, 4, [0])
    cfg = compose(overrides)
    check(cfg, 4)
    planned = predict(cfg, 4).comm_bytes["ep"]["all_to_all"]
    counts_exchange = 2 * 4 * (8 * 8) / 2  # MoE blocks on stage 0 x micro batches x bytes / 2
    assert counts_exchange < planned and report.comm["ep"]["all_to_all"].sent_bytes == planned


@pytest.mark.parametrize("mode", ["op", "selective"])
def test_recomputed_blocks_exchange_their_tokens_again_as_planned(mode):
    """A recomputed MoE block (op: the combine's output is no matmul's, so the replay reaches both
    all-to-alls; selective: the checkpointed blocks only) sends its tokens again in backward."""
    from parallel3d.planner import predict
    from parallel3d.planner.dryrun import dry_run

    overrides = [*FAST, *MOE, "parallel.ep=2", f"model.activation_checkpoint={mode}", "run_dir=/nonexistent"]
    [report] = dry_run(overrides, 2, [0])
    cfg = compose(overrides)
    check(cfg, 2)
    without = compose([*overrides[:-2], "run_dir=/nonexistent"])
    check(without, 2)
    planned = predict(cfg, 2).comm_bytes["ep"]["all_to_all"]
    assert planned > predict(without, 2).comm_bytes["ep"]["all_to_all"]
    assert report.comm["ep"]["all_to_all"].sent_bytes == planned


@pytest.mark.multirank
def test_hugging_face_weights_load_into_sharded_experts(parity, moe_reference, moe_tolerance):
    """A checkpoint exported in Qwen3-MoE's layout (one tensor per expert) starts ep2 x dp4, where each
    rank reads half of its ep rank's experts (FSDP over expert_dp), where it starts one process."""
    from parallel3d.cli import convert_hf

    source = parity.train(SAVING, prefix="moe-", extra=MOE)
    export = parity.root / "moe-step4-hf"
    assert convert_hf.main(["export", str(source.run_dir / "checkpoints" / "step_4"), str(export)]) == 0
    init = [*FAST, *MOE, "train.steps=2", f"checkpoint.init_from={export}"]
    single = launch(parity.root / "moe-init-single", init)
    sharded = launch(parity.root / "moe-init-ep2-dp4", [*init, "parallel.ep=2", "parallel.zero_stage=3"], nproc=4)
    single.assert_finished(2)
    sharded.assert_finished(2)
    assert_matches(single, sharded, tolerance=moe_tolerance, metrics=("loss",))  # 2 steps: within the 6 steps' bound
    assert single.losses[0] < moe_reference.losses[0] - 1.0  # trained weights, not a fresh init


def test_dry_run_shards_the_experts_and_sums_the_aux_counts_as_planned():
    """ep2 x cp2 x dp2, ZeRO-3 (ep takes the cp ranks, expert_dp the dp ones): the experts' own FSDP
    units gather and reduce-scatter over expert_dp, and each MoE block forward all-reduces its
    sequences' expert counts (b x 8 float32) over cp, exactly the bytes the planner counts."""
    from parallel3d.planner import predict
    from parallel3d.planner.dryrun import dry_run

    overrides = [*FAST, *MOE, "parallel.ep=2", "parallel.cp=2", "parallel.zero_stage=3",
                 "train.micro_batch_size=2", "run_dir=/nonexistent"]
    [report] = dry_run(overrides, 4, [0])
    cfg = compose(overrides)
    check(cfg, 4)
    planned = predict(cfg, 4).comm_bytes
    assert {kind: c.sent_bytes for kind, c in report.comm["expert_dp"].items()} == planned["expert_dp"]
    assert set(planned["expert_dp"]) == {"all_gather", "reduce_scatter"}
    # 4 blocks x 4 micro batches (8 sequences per dp rank) x a ring all-reduce of 2 x 8 float32 on 2 ranks
    assert planned["cp"]["all_reduce"] == 4 * 4 * 2 * (2 * 8 * 4) * (2 - 1) / 2
    assert report.comm["cp"]["all_reduce"].sent_bytes == planned["cp"]["all_reduce"]
