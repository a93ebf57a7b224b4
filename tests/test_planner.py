"""The planner predicts what the code does: model-state bytes exactly (against ranks built on torch's
fake process group here, and against every parity run in conftest.Parity), activations to the
byte on CPU (tests/test_planner_activations.py), bubbles as torch's own schedules idle, and it
recommends the layouts practice does.

Ranks are built in forks of this process, one per fake rank (DTensor caches layouts per mesh, and
the meshes of different ranks compare equal); no torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.models import Transformer
from parallel3d.observe.metrics import model_state_bytes
from parallel3d.optim.adamw import build_optimizer
from parallel3d.parallel.compose import ParallelPlan, parallelize
from parallel3d.parallel.mesh import ParallelDims, build_mesh
from parallel3d.parallel.pipeline import V_SCHEDULES, TiedEmbeddings, build_parts
from parallel3d.planner import Hardware, SearchSpace, predict, rank_layouts
from parallel3d.planner.comm import ring
from parallel3d.planner.plan import make_plan
from parallel3d.planner.schedule import _simulated_microbatches, bubble_fraction, in_flight_microbatches
from parallel3d.validate import check

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
from draw_layout import DURATION, schedule_actions, timeline  # noqa: E402

SMALL = ["run_dir=.", "checkpoint.resume=none", "train.seq_len=32"]


def in_fork(fn, *args):
    """fn(*args) in a forked child (a fresh fake rank); its result, or its exception re-raised."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()

    def target():
        torch.set_num_threads(1)
        try:
            child.send(fn(*args))
        except BaseException as e:  # noqa: BLE001 - shipped back to the test
            child.send(e)

    proc = ctx.Process(target=target)
    proc.start()
    child.close()  # so that a child that dies makes recv() fail instead of wait
    try:
        if not parent.poll(300):
            raise TimeoutError(f"{fn.__name__}{args[1:]} took more than 300 s")
        result = parent.recv()
    finally:
        proc.kill()
        proc.join()
    if isinstance(result, BaseException):
        raise result
    return result


def _config(overrides: list[str], world: int):
    """The composed config (for predict) and its validated dataclass (for building ranks)."""
    cfg = compose([*SMALL, *overrides])
    return cfg, OmegaConf.to_object(check(cfg, world))


def _build(c, meshes, pp_rank: int):
    if meshes.pp is not None:
        return [part for _, part in build_parts(c.model, c.parallel, pp_rank)]
    with torch.device("meta"):
        return [Transformer(c.model)]


# ---------------------------------------------------------------------------------------------
# Model state: exact


def measured_model_state(c, world: int, rank: int) -> dict[str, int]:
    """One fake rank, as train.py builds it: parallelize, materialize, one forward/backward per
    stage, the tied-gradient sum, one optimizer step; then what metrics.jsonl would log."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        meshes = build_mesh(ParallelDims.from_config(c.parallel), "cpu")
        parts = _build(c, meshes, meshes.pp.get_local_rank() if meshes.pp else 0)
        for part in parts:
            parallelize(part, meshes, ParallelPlan.from_config(c))
            part.to_empty(device="cpu")
            part.init_weights(0)
        model = parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)
        optimizer = build_optimizer(model, c.optim)
        vocab_parallel = loss_parallel if meshes.tp is not None else contextlib.nullcontext
        b, s = c.train.micro_batch_size, c.train.seq_len
        for part in parts:
            x = torch.randint(0, 256, (b, s)) if part.embeds_input else torch.randn(b, s, c.model.dim)
            with vocab_parallel():
                out = part(x)
                (out.to_local() if isinstance(out, DTensor) else out).float().sum().backward()
        if c.model.tie_embeddings and meshes.pp is not None:
            TiedEmbeddings(parts, meshes.world, c.parallel.pp_schedule in V_SCHEDULES).sync_gradients()
        optimizer.step()
        return model_state_bytes(model, optimizer)
    finally:
        dist.destroy_process_group()


# Edge cases beyond the parity matrix (which conftest.Parity checks on real runs): uneven FSDP and
# ZeRO-1 chunks, HSDP with ZeRO-1, size-based FSDP units, tied V-schedule stages with 3 pp ranks.
STATE_CASES = {
    "dp3-zero3-uneven": (3, ["parallel.zero_stage=3", "model.vocab_size=500", "model.ffn_dim=390",
                             "train.global_batch_size=6"]),
    "dp3-tp2-zero1-uneven": (6, ["parallel.zero_stage=1", "parallel.tp=2", "model.dim=120", "model.ffn_dim=300",
                                 "model.vocab_size=514", "train.global_batch_size=6", "train.micro_batch_size=1"]),
    # The untied embedding split over its dim (vocab x dim/tp), FSDP's rows over 4: 65 x 3 + 62
    # rows of 256 where a vocabulary split would give 129 x 3 + 127 of 128.
    "dp4-tp2-zero3-embedding": (8, ["parallel.zero_stage=3", "parallel.tp=2", "model.vocab_size=514",
                                    "train.global_batch_size=8", "train.micro_batch_size=1"]),
    "hsdp2x1-zero1": (2, ["parallel.zero_stage=1", "parallel.dp_replicate=2"]),
    "hsdp2x2-zero2-sizewrap": (4, ["parallel.zero_stage=2", "parallel.dp_replicate=2", "parallel.fsdp_wrap=size",
                                   "parallel.fsdp_min_params=50000"]),
    "pp3-ZBV-zero2-tied": (6, ["parallel.pp=3", "parallel.pp_schedule=ZBVZeroBubble", "parallel.zero_stage=2",
                               "model.tie_embeddings=true", "model.n_layers=5", "train.global_batch_size=12",
                               "train.micro_batch_size=1"]),
}


@pytest.mark.parametrize("name", list(STATE_CASES))
def test_model_state_is_exact_on_every_rank(name):
    world, overrides = STATE_CASES[name]
    cfg, c = _config(overrides, world)
    plan = predict(cfg, world)
    measured = [in_fork(measured_model_state, c, world, rank) for rank in range(world)]
    for rank, state in enumerate(measured):
        assert vars(plan.rank_model_state(rank)) == state, f"rank {rank}"
    assert plan.model_state_bytes == {k: max(m[k] for m in measured) for k in measured[0]}


@pytest.mark.fast
def test_sharding_arithmetic_by_hand():
    """tiny (0.92M params) on 4 ranks: after a step ZeRO-1 to 3 hold a quarter of everything (plus
    one 4-byte AdamW step per parameter tensor), DDP all of it."""
    params = 918_656
    tensors = 4 * 9 + 3  # per block: 2 norms + 7 matrices; embedding, final norm, output
    for stage, expected in [(0, (4 * params, 4 * params, 8 * params)), (1, (params, params, 2 * params)),
                            (3, (params, params, 2 * params))]:
        plan = predict(compose([f"parallel.zero_stage={stage}"]), 4)
        assert (plan.param_bytes, plan.grad_bytes, plan.optim_state_bytes - 4 * tensors) == expected


# ---------------------------------------------------------------------------------------------
# Pipeline schedules


SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def simulated_bubble(schedule: str, p: int, m: int, v: int) -> float:
    """Idle share of torch's own action order placed in time (forward 1, backward 2, split
    backward 1 + 1), as tools/draw_layout.py draws it."""
    placed = timeline(schedule_actions(schedule, p, m, v), p * v)
    span = max(start + DURATION[kind] for rank in placed for kind, _, _, start in rank)
    busy = sum(DURATION[kind] for rank in placed for kind, *_ in rank)
    return 1 - busy / (p * span)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("p", [2, 4])
def test_bubble_formulas_match_torchs_schedules(schedule, p):
    v = 1 if schedule in ("GPipe", "1F1B") else 2
    for m in range(p, 4 * p + 1):
        try:
            simulated = simulated_bubble(schedule, p, m, v)
        except (ValueError, RuntimeError):  # torch refuses this microbatch count (so does validation)
            continue
        assert bubble_fraction(schedule, p, m, v) == pytest.approx(simulated, abs=1e-9), (m, simulated)


@pytest.mark.fast
def test_bubble_textbook_values():
    assert bubble_fraction("1F1B", 4, 8) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)  # (p-1)/(vm+p-1)
    assert bubble_fraction("1F1B", 1, 8) == 0
    assert bubble_fraction("ZBVZeroBubble", 8, 32, 2) < bubble_fraction("Interleaved1F1B", 8, 32, 2)


def _layout(schedule: str, p: int, m: int, v: int):
    from parallel3d.planner.layout import Layout

    return Layout(1, 1, 1, p, 0, pp_schedule=schedule, stages_per_rank=v, global_batch_size=m, micro_batch_size=1)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (8, 16), (8, 24)])
def test_microbatches_in_flight_follow_the_closed_forms(p, m):
    for r in range(p):
        assert sum(in_flight_microbatches(_layout("1F1B", p, m, 1), r).values()) == p - r
        assert sum(in_flight_microbatches(_layout("GPipe", p, m, 1), r).values()) == m
        per_round = m // (m // p)  # torch's interleaved warmup: (v-1)·m/rounds + 2(p-1-r) + 1 chunks
        expected = min(2 * m, per_round + 2 * (p - 1 - r) + 1)
        assert sum(in_flight_microbatches(_layout("Interleaved1F1B", p, m, 2), r).values()) == expected


@pytest.mark.parametrize("schedule,v", [("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_shortened_replay_keeps_the_peak(schedule, v):
    p, m = 4, 48
    assert _simulated_microbatches(schedule, p, m) < m
    for r in range(p):
        short = in_flight_microbatches(_layout(schedule, p, m, v), r)
        from parallel3d.planner import schedule as sched

        full = {}
        held = {}
        for kind, stage in sched._actions(schedule, p, m, v)[r]:
            held[stage] = held.get(stage, 0) + (kind == "F") - (kind in ("B", "W"))
            if sum(held.values()) > sum(full.values()):
                full = dict(held)
        assert short == full


# ---------------------------------------------------------------------------------------------
# Communication


def _bytes(plan, group: str, kind: str) -> float:
    return plan.comm_bytes.get(group, {}).get(kind, 0.0)


def test_zero3_gathers_blocks_twice_the_root_once_and_reduce_scatters_once_per_micro_batch():
    numel = 918_656  # tiny: every dim divides by 4, so FSDP pads nothing
    root = 2 * 512 * 128 + 128  # embedding, output, final norm
    plan = predict(compose(["parallel.zero_stage=3", "train.micro_batch_size=4"]), 4)  # 1 micro batch
    assert _bytes(plan, "dp_shard", "all_gather") == 4 * (2 * numel - root) * 3 / 4
    assert _bytes(plan, "dp_shard", "reduce_scatter") == 4 * numel * 3 / 4
    accumulating = predict(compose(["parallel.zero_stage=3", "train.micro_batch_size=1"]), 4)  # 4 of them
    assert _bytes(accumulating, "dp_shard", "all_gather") == 4 * _bytes(plan, "dp_shard", "all_gather")
    zero2 = predict(compose(["parallel.zero_stage=2", "train.micro_batch_size=4"]), 4)
    assert _bytes(zero2, "dp_shard", "all_gather") == 4 * numel * 3 / 4
    # Under pp ZeRO-3 keeps parameters gathered through the schedule step, as ZeRO-2 does.
    piped = ["parallel.pp=2", "train.micro_batch_size=1"]
    assert (predict(compose([*piped, "parallel.zero_stage=3"]), 4).comm_bytes
            == predict(compose([*piped, "parallel.zero_stage=2"]), 4).comm_bytes)


def test_ddp_all_reduces_and_zero1_gathers_and_reduce_scatters_once_per_step():
    numel = 918_656
    for mbs in (4, 1):  # accumulation reduces on the last micro batch only
        plan = predict(compose(["parallel.zero_stage=0", f"train.micro_batch_size={mbs}"]), 4)
        assert plan.comm_bytes == {"dp": {"all_reduce": 2 * 4 * numel * 3 / 4}}
        zero1 = predict(compose(["parallel.zero_stage=1", f"train.micro_batch_size={mbs}"]), 4)
        assert zero1.comm_bytes == {"dp": {"all_gather": 4 * numel * 3 / 4, "reduce_scatter": 4 * numel * 3 / 4}}
    assert ring("all_reduce", 100, 4) == 2 * ring("all_gather", 100, 4) == 2 * ring("reduce_scatter", 100, 4) == 150


def test_hsdp_reduces_the_shard_across_replicas():
    plan = predict(compose(["parallel.dp_replicate=2", "parallel.zero_stage=3", "train.micro_batch_size=4"]), 4)
    shard = 4 * 918_656 / 2
    assert _bytes(plan, "dp_replicate", "all_reduce") == 2 * shard * 1 / 2
    assert _bytes(plan, "dp_shard", "reduce_scatter") == 2 * shard * 1 / 2


def test_tensor_parallel_traffic_per_block():
    """tp 2 on GPUs, one micro batch of 16 x 64 tokens: per block 4 all-gathers and 4 reduce-scatters
    (forward and backward) of b·s·dim floats with sequence parallelism, or 4 all-reduces without;
    the same bytes either way. The output projection adds one of each; the embedding (split over
    its dim) an all-to-all each way of its 1/tp slice, or one all-gather without SP."""
    act = 16 * 64 * 128 * 4
    gpu = ["parallel.tp=2", "train.micro_batch_size=16", "train.seq_len=64", "train.device=cuda"]
    sp = predict(compose(gpu), 2)
    assert _bytes(sp, "tp", "all_gather") == (4 * 4 + 1) * act / 2
    assert _bytes(sp, "tp", "reduce_scatter") == _bytes(sp, "tp", "all_gather")
    assert _bytes(sp, "tp", "all_to_all") == 2 * (act / 2) / 2
    no_sp = predict(compose([*gpu, "parallel.sequence_parallel=false"]), 2)
    assert _bytes(no_sp, "tp", "all_reduce") == pytest.approx(
        _bytes(sp, "tp", "all_gather") + _bytes(sp, "tp", "reduce_scatter"), rel=0.01)
    assert _bytes(no_sp, "tp", "all_gather") == act / 2
    full = predict(compose([*gpu, "model.activation_checkpoint=full"]), 2)
    assert _bytes(full, "tp", "all_gather") == (4 * 6 + 1) * act / 2  # recompute repeats the forward's
    assert _bytes(full, "tp", "reduce_scatter") == (4 * 5 + 1) * act / 2  # ... up to wo's reduction
    # Tied, the embedding is split over the vocabulary: its output reduce-scattered, gathered back.
    tied = predict(compose([*gpu, "model.tie_embeddings=true"]), 2)
    assert _bytes(tied, "tp", "all_gather") == _bytes(tied, "tp", "reduce_scatter") == (4 * 4 + 2) * act / 2
    assert _bytes(tied, "tp", "all_to_all") == 0


def test_pipeline_sends_activations_and_gradients():
    plan = predict(compose(["parallel.pp=2", "train.micro_batch_size=2", "train.seq_len=64"]), 2)  # 8 microbatches
    assert plan.comm_bytes["pp"] == {"send_recv": 8 * 2 * 64 * 128 * 4}
    v = predict(compose(["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "train.micro_batch_size=2",
                         "train.seq_len=64"]), 2)
    assert v.comm_bytes["pp"]["send_recv"] == 8 * 2 * (2 * 64 * 128 * 4)  # middle stages: both ways


# ---------------------------------------------------------------------------------------------
# Recommendations


def _cluster_config(model: str, *, seq_len: int, global_batch_size: int):
    """A model trained in bf16 with these sequences and batch (the rest: the default recipe's)."""
    return compose([f"model={model}", f"train.seq_len={seq_len}", f"train.global_batch_size={global_batch_size}",
                    "train.param_dtype=bfloat16", "train.reduce_dtype=float32"])


@pytest.mark.fast
def test_small_model_on_one_node_gets_plain_data_parallelism():
    cands = rank_layouts(_cluster_config("llama3_1b", seq_len=2048, global_batch_size=64), 8)
    best = next(c for c in cands if c.recommended)
    assert (best.layout.tp, best.layout.pp, best.layout.dp) == (1, 1, 8)
    assert all(c.plan.fits for c in cands)


def test_70b_on_8_nodes_gets_tensor_parallelism_inside_nodes():
    cands = rank_layouts(_cluster_config("llama3_70b", seq_len=8192, global_batch_size=1024), 64,
                         space=SearchSpace(micro_batch_sizes=(1, 2)))
    best = next(c for c in cands if c.recommended)
    assert best.layout.tp == 8
    assert best.layout.pp * best.layout.dp == 8
    assert best.plan.peak_bytes <= 0.9 * 80 * 2**30


def test_tensor_parallelism_never_wins_across_nodes():
    """Allowed to cross nodes (4 GPUs each), tp 8 and 16 still lose to layouts that keep tp inside."""
    cands = rank_layouts(_cluster_config("llama3_8b", seq_len=4096, global_batch_size=64), 16,
                         hardware=Hardware(gpus_per_node=4),
                         space=SearchSpace(micro_batch_sizes=(1,), allow_cross_node_tp=True))
    inside = [c for c in cands if c.layout.tp <= 4]
    across = [c for c in cands if c.layout.tp > 4]
    assert across and inside
    assert min(c.step_s for c in inside) < min(c.step_s for c in across)
    assert next(c for c in cands if c.recommended).layout.tp <= 4


def test_long_context_recipe_is_what_the_planner_recommends():
    """Llama 3 8B at 128K tokens, 8 sequences a step on 64 GPUs: dp can reach 8 at most, and tp 8
    alone loses to cp 2 x tp 4 (recipes/llama3_8b_128k.yaml). Our ring attention materializes its
    sub-blocks' scores (parallel/context.py), so at 128K it needs more memory than all-to-all."""
    cands = rank_layouts(_cluster_config("llama3_8b", seq_len=131072, global_batch_size=8), 64,
                         space=SearchSpace(micro_batch_sizes=(1,), cp_degrees=(1, 2, 4, 8, 16)))
    best = next(c for c in cands if c.recommended)
    recipe = compose(["recipe=llama3_8b_128k", "run_dir=/nonexistent"])
    p = recipe.parallel
    assert (best.layout.dp, best.layout.cp, best.layout.tp, best.layout.pp) == (p.dp_shard, p.cp, p.tp, p.pp)
    assert (best.layout.cp_method, best.layout.zero_stage) == (p.cp_method, p.zero_stage)
    assert best.layout.activation_checkpoint == recipe.model.activation_checkpoint
    without_cp = [c for c in cands if c.layout.cp == 1]
    assert without_cp and best.step_s < min(c.step_s for c in without_cp)
    # cp divides the activations: the same layout's activation bytes halve from cp 1 to cp 2
    lay = best.layout
    halved = make_plan(best.plan.model, dataclasses.replace(lay, cp=1, dp_shard=16)).activation_bytes
    assert best.plan.activation_bytes * 2 == pytest.approx(halved, rel=1e-3)


def test_predict_validates_and_leaves_the_config_alone():
    cfg = compose(["parallel.tp=2"])
    with pytest.raises(ConfigError):
        predict(cfg, 3)
    plan = predict(cfg, 4, Hardware())
    assert cfg.parallel.dp_shard == -1 and plan.layout.dp_shard == 2
    assert plan.step_time.total_s > 0 and plan.fits
    dataclass_cfg = OmegaConf.to_object(compose(["run_dir=.", "checkpoint.resume=none", "parallel.tp=2"]))
    assert predict(dataclass_cfg, 4).model_state_bytes == plan.model_state_bytes


@pytest.mark.fast
def test_cli_ranks_and_breaks_down(tmp_path, capsys):
    from parallel3d.cli.plan_layout import main

    assert main(["model=llama3_1b", "--gpus", "8", "--seq-len", "2048", "--global-batch", "64", "--top", "3",
                 "--json", str(tmp_path / "plans.json")]) == 0
    out = capsys.readouterr().out
    assert "recommended" in out and "\n*" in out and "MFU" in out
    import json

    saved = json.loads((tmp_path / "plans.json").read_text())
    assert saved["candidates"][saved["recommended"]]["recommended"]
    assert main(["parallel.tp=2", "parallel.pp=2", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "pp rank" in out and "send_recv" in out and "pipeline bubble" in out
