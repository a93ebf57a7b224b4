"""Fault tolerance across replica groups (parallel3d/ft/, docs/fault-tolerance.md): the keys, the
roster each quorum sums, the membership log's lineage, the state a heal copies (in one process),
and, with real groups under a lighthouse, kills, heals and refusals (tests/ft_cluster.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))  # ft_cluster: groups as jobs

from parallel3d.base import ConfigError  # noqa: E402
from parallel3d.config.compose import compose  # noqa: E402
from parallel3d.ft.membership import (MembershipLog, Roster, config_fingerprint, read_membership,  # noqa: E402
                                      roster_row)
from parallel3d.ft.replay import replay, replay_diloco  # noqa: E402
from parallel3d.validate import check  # noqa: E402

import torchft  # noqa: E402, F401  (a dev dependency: missing, the file fails)

FT = ["ft.enabled=true", "ft.lighthouse=http://localhost:29510"]

# (overrides, world size, key the message must name, words it must contain)
BAD = [
    (["ft.enabled=true"], 1, "ft.lighthouse", "parallel3d-lighthouse"),
    ([*FT, "ft.lighthouse=localhost:29510"], 1, "ft.lighthouse", "http://HOST:PORT"),
    ([*FT, "ft.replica_id=2"], 1, "ft.replica_id", "0..1"),
    ([*FT, "ft.min_replicas=3"], 1, "ft.min_replicas", "ft.replicas=2"),
    ([*FT, "ft.semi_sync=streaming"], 1, "ft.semi_sync", "none"),
    ([*FT, "ft.quorum_timeout_s=0"], 1, "ft.quorum_timeout_s", "> 0"),
    ([*FT, "train.global_batch_size=12"], 2, "train.global_batch_size", "ft.replicas=2 x"),
    ([*FT, "train.on_bad_step=skip"], 1, "train.on_bad_step", "stop"),
    (["debug.ft_fail_steps=[2]"], 1, "debug.ft_fail_steps", "ft.enabled=true"),
    ([*FT, "ft.semi_sync=diloco", "ft.diloco.inner_steps=0"], 1, "ft.diloco.inner_steps", ">= 1"),
    ([*FT, "ft.semi_sync=diloco", "ft.diloco.inner_steps=3", "train.steps=10"], 1, "train.steps", "between two syncs"),
    ([*FT, "ft.semi_sync=diloco", "ft.diloco.outer_momentum=1"], 1, "ft.diloco.outer_momentum", "outer_lr=0.7"),
]


@pytest.mark.parametrize("overrides,world_size,key,words", BAD, ids=[b[2] for b in BAD])
def test_ft_keys_are_refused_before_any_process_group_in_one_line(overrides, world_size, key, words):
    with pytest.raises(ConfigError) as refused:
        check(compose(["run_dir=/nonexistent", *overrides]), world_size)
    message = str(refused.value)
    assert refused.value.key == key and words in message and "\n" not in message, message


def test_a_valid_ft_config_passes_and_each_group_trains_its_slice_of_the_batch():
    from parallel3d.config.fault_tolerance import batch_share, check_ft

    cfg = check(compose(["run_dir=/nonexistent", *FT, "ft.replica_id=1"]), 2)
    assert batch_share(OmegaConf.to_object(cfg)) == (1, 2)
    cfg.data.format = "chat"  # past data's own checks (its files), the ft check alone
    with pytest.raises(ConfigError, match="data.format=chat: fault tolerance averages"):
        check_ft(cfg)


def test_the_fingerprint_is_the_config_groups_share_not_their_id_or_run_dir():
    def fingerprint(*overrides):
        return config_fingerprint(OmegaConf.to_object(check(compose([*FT, *overrides]), 1)))

    one = fingerprint("run_dir=/a", "ft.replica_id=0", "ft.timeout_s=5")
    assert one == fingerprint("run_dir=/b", "ft.replica_id=1", "ft.timeout_s=9")
    assert one != fingerprint("run_dir=/a", "model.n_layers=2")
    assert one != fingerprint("run_dir=/a", "optim.lr=1e-3")


def _summed(*rows) -> torch.Tensor:
    return sum(roster_row(replicas=3, replica_id=r, newcomer=n, healed=h, fingerprint=f) for r, n, h, f in rows)


def test_the_roster_names_participants_heals_and_refuses_newcomers_only():
    roster = Roster.read(_summed((0, False, False, 7), (2, True, True, 7)), replicas=3)
    assert (roster.participants, roster.healed, roster.clean) == ([0, 2], [2], True)
    twice = Roster.read(_summed((0, False, False, 7), (0, True, False, 7)), replicas=3)
    assert twice.duplicates == [0] and not twice.clean
    assert "another live replica group has this id" in twice.refusal(replica_id=0, newcomer=True)
    assert twice.refusal(replica_id=0, newcomer=False) is None  # the group already training stays
    differs = Roster.read(_summed((1, False, False, 7), (2, True, False, 8)), replicas=3)
    assert differs.mismatched == [2] and differs.reference == 1
    assert "differs from the quorum's (replica group 1)" in differs.refusal(replica_id=2, newcomer=True)
    assert differs.refusal(replica_id=1, newcomer=False) is None


def _line(step, writer, participants, healed=(), t=0.0):
    roster = Roster(participants=list(participants), healed=list(healed), duplicates=[], mismatched=[], reference=0)
    log = MembershipLog(Path("/nonexistent"), replicas=2, global_batch_size=16, enabled=False)
    return {**log.entry(step, roster, writer), "time": t}


@pytest.mark.fast
def test_the_log_walk_follows_heals_and_drops_steps_a_restart_undid(tmp_path):
    lines = [
        _line(1, 0, [0, 1], t=1), _line(1, 1, [0, 1], t=1),
        _line(2, 0, [0], t=2),  # group 1 died
        _line(1, 1, [1], t=3), _line(2, 1, [1], t=4),  # group 1 restarted alone from nothing...
        _line(3, 0, [0, 1], [1], t=5), _line(3, 1, [0, 1], [1], t=5),  # ...and healed from group 0
    ]
    for writer in (0, 1):
        own = [json.dumps(e) + "\n" for e in lines if e["replica_id"] == writer]
        (tmp_path / f"{writer}.jsonl").write_text("".join(own))
    chain = read_membership([tmp_path / "0.jsonl", tmp_path / "1.jsonl"])
    assert [(s, e["replica_id"], e["participants"], e["time"]) for s, e in chain.items()] == [
        (1, 0, [0, 1], 1), (2, 0, [0], 2), (3, 0, [0, 1], 5)]
    assert (chain[2]["trained_slices"], chain[2]["dropped_slices"], chain[2]["samples_dropped"]) == ([0], [1], 8)


def _run_state(overrides, seed):
    from types import SimpleNamespace

    from parallel3d.checkpoint.checkpointer import TrainState
    from parallel3d.ft.state import RunState
    from parallel3d.runtime.guard import BadStepGuard
    from parallel3d.step import build_setup

    cfg = check(compose(["train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=16",
                         "run_dir=/nonexistent", "train.spike_factor=5", *overrides]), 1)
    c = OmegaConf.to_object(cfg)
    setup = build_setup(c, torch.device("cpu"))
    guard = BadStepGuard.for_run(c.train, c.debug)
    run = RunState(train=TrainState(setup.parts, setup.optimizer, setup.scheduler), guard=guard,
                   sampler=SimpleNamespace(offset=0), fingerprint=config_fingerprint(c), replica_id=seed)
    torch.manual_seed(seed)
    return setup, run


def _steps(setup, guard, n, seed):
    from parallel3d.step import train_step

    g = torch.Generator().manual_seed(seed)
    vocab = setup.config.model.vocab_size
    for _ in range(n):
        batches = [(torch.randint(0, vocab, (2, 16), generator=g), torch.randint(0, vocab, (2, 16), generator=g))
                   for _ in range(2)]
        train_step(setup, batches, guard=guard)
        setup.optimizer.zero_grad(set_to_none=True)


# The sigmoid router's balancing bias (a buffer the optimizer never sees); float8 matmuls (emulated).
HEALED_MODELS = {"moe-sigmoid": ["model=tiny_moe", "model.moe.router=sigmoid"],
                 "float8": ["train.float8=tensorwise", "train.float8_skip_small=false"]}


@pytest.mark.parametrize("model", list(HEALED_MODELS))
def test_a_heal_copies_everything_that_defines_the_run_bitwise(model):
    """A group that trained 3 steps sends its state (through torch.save, as torchft's HTTP transport
    does) to a fresh one: weights, router biases, optimizer moments and step counts, the lr in the
    param groups and the scheduler, RNG, data position, guard. Both then train one more step on one
    batch and stay bitwise equal; a peer of another config is refused in one line."""
    from parallel3d.base import RunError
    from parallel3d.ft.state import apply_heal_state, heal_state, state_digest

    live, live_run = _run_state(HEALED_MODELS[model], seed=0)
    _steps(live, live_run.guard, 3, seed=1)
    live_run.sampler.offset = 32
    fresh, fresh_run = _run_state(HEALED_MODELS[model], seed=1)
    sent = heal_state(live_run)
    buffer = io.BytesIO()
    torch.save(sent, buffer)
    buffer.seek(0)
    torch.manual_seed(123)  # the receiver's own stream, replaced by the peer's
    apply_heal_state(fresh_run, torch.load(buffer, weights_only=False))
    assert torch.equal(torch.get_rng_state(), sent["rng"]["cpu"])
    assert fresh.scheduler.state_dict() == live.scheduler.state_dict()
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [g["lr"] for g in live.optimizer.param_groups]
    assert fresh_run.guard.state_dict() == live_run.guard.state_dict() and fresh_run.sampler.offset == 32
    assert state_digest(fresh_run) == state_digest(live_run)
    for setup in (live, fresh):
        _steps(setup, None, 1, seed=2)
    for (name, a), b in zip(live.model.state_dict().items(), fresh.model.state_dict().values()):
        assert torch.equal(a, b), name  # parameters and the routers' bias buffers
    for a, b in zip(live.optimizer.state.values(), fresh.optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    other, other_run = _run_state([*HEALED_MODELS[model], "model.n_layers=2"], seed=2)
    with pytest.raises(RunError, match="trains another config") as refused:
        apply_heal_state(other_run, heal_state(live_run))
    assert "\n" not in str(refused.value)


def _group_config(address: str, steps: int) -> list[str]:
    # optim.lr=1e-3: float32 round-off between the groups' sums and one process's grows along the
    # steps slower than at the default 3e-3, so the oracle's 1e-6 on the weights measures the run.
    return [f"train.steps={steps}", "optim.warmup_steps=2", "optim.lr=1e-3", "train.seq_len=64",
            "train.global_batch_size=16", "optim.eps=1e-6", "ft.enabled=true", f"ft.lighthouse={address}",
            "ft.replicas=2", "ft.timeout_s=20", "ft.quorum_timeout_s=120", "train.save_model=true",
            "checkpoint.every=5",
            "debug.ft_alone_sleep_s=6"]  # a survivor slow enough for the restarted group to find it training


@contextlib.contextmanager
def one_torch_thread():
    """A replay computes as each group's ranks did: one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _replayed_weights(overrides: list[str], logs: list[Path], out: Path) -> dict:
    """The oracle: one process retrains the log's chain of steps; its export, read as the groups' are."""
    from harness.runs import final_weights

    from parallel3d.checkpoint.checkpointer import full_model_state
    from parallel3d.hf.export import save_run_model

    c = OmegaConf.to_object(check(compose([f"run_dir={out}", *overrides]), 1))
    with one_torch_thread():
        setup = replay(c, logs)
    out.mkdir()
    save_run_model(out, full_model_state(setup.parts, None), model_cfg=c.model, tokenizer=c.data.tokenizer)
    return final_weights(out)


@pytest.mark.multirank
def test_a_killed_group_heals_from_its_live_peer_and_the_log_replays_to_the_weights(tmp_path):
    """Two groups of 2 ranks (dp_shard=2) under one lighthouse, 21 faults: each group's side of the
    all-reduce fails at 10 random steps (every group discards the step and trains it again), and
    one rank of group 1 is SIGKILLed after 3 steps together (torchrun takes the group down); group 0
    trains on alone, dropping slice 1; group 1, started again with the same command, heals from
    group 0 and says so in one line, and at every heal both groups log equal digests of each rank's
    whole state. Both export bitwise-equal weights, only group 0 wrote checkpoints, and one process
    replaying the membership log ends with the same weights within 1e-6."""
    from harness.runs import final_weights
    from ft_cluster import group_job, membership, start_lighthouse, wait_for

    lighthouse, address = start_lighthouse(tmp_path)
    jobs = [lighthouse]
    try:
        common = _group_config(address, steps=24)
        fails = [sorted(random.Random(seed).sample(range(2, 25), 10)) for seed in (0, 1)]  # injected, per group
        g0, g1 = (group_job(tmp_path, g, [*common, f"debug.ft_fail_steps=[{','.join(map(str, fails[g]))}]"])
                  for g in (0, 1))
        jobs += [g0.start(), g1.start()]
        both = lambda: sum(e["participants"] == [0, 1] for e in membership(tmp_path / "group1")) >= 3  # noqa: E731
        wait_for(both, 300, lambda: g1.stderr[-3000:])
        os.kill(max(g1.ranks()), signal.SIGKILL)  # one rank: torchrun ends the rest of the group
        g1.wait(120)
        before_restart = len(g1.stdout)
        g1.start()  # the same command, the same run_dir (its lock taken over from the dead job)
        assert g0.wait(300) == 0, g0.stderr[-3000:]
        assert g1.wait(300) == 0, g1.stderr[-3000:]
    finally:
        for job in jobs:
            if job.proc is not None and job.proc.poll() is None:
                job.kill()
    heal_lines = [line for line in g1.stdout[before_restart:].splitlines() if "parallel3d: ft: heal" in line]
    assert len(heal_lines) == 1 and "from replica group 0" in heal_lines[0], g1.stdout[before_restart:]
    logs = [tmp_path / f"group{g}" / "ft" / "membership.jsonl" for g in (0, 1)]
    chain = read_membership(logs)  # the steps the final weights descend from
    assert list(chain) == list(range(1, 25))
    discarded = {step for step, e in chain.items() if e["discarded_attempts"]}
    # Group 0 lives throughout: each of its failures was discarded by every group in that attempt's
    # quorum (a group that joined at a later attempt of the step, healing there, never saw it).
    for g in (0, 1):
        witnesses = [e for e in membership(tmp_path / f"group{g}")
                     if e["step"] in fails[0] and 0 in e["participants"] and g not in e["healed"]]
        assert witnesses and all(e["discarded_attempts"] for e in witnesses), (g, witnesses)
        assert g == 1 or {e["step"] for e in witnesses} == set(fails[0]), witnesses
    assert set(fails[1]) & discarded - set(fails[0])  # and some of group 1's
    alone = [e for e in chain.values() if e["participants"] == [0]]
    assert alone and all(e["dropped_slices"] == [1] and e["samples_dropped"] == 8 for e in alone)
    healed_at = [step for step, e in chain.items() if e["healed"] == [1]]
    assert healed_at
    for step in healed_at:  # right after the heal, each rank's whole state is the same in both groups
        digests = [[e["state_digests"] for e in membership(tmp_path / f"group{g}") if e["step"] == step][-1]
                   for g in (0, 1)]
        assert digests[0] == digests[1] and len(digests[0]) == 2, digests
    weights = final_weights(tmp_path / "group0")
    assert all(torch.equal(weights[k], v) for k, v in final_weights(tmp_path / "group1").items())
    assert (tmp_path / "group0" / "checkpoints" / "step_24" / "COMPLETE").exists()
    assert not (tmp_path / "group1" / "checkpoints").exists()
    replayed = _replayed_weights(common, logs, tmp_path / "replay")
    worst = max((weights[k] - replayed[k]).abs().max().item() for k in weights)
    assert worst <= 1e-6, worst


def _one_line(job_stderr: str, words: str) -> str:
    lines = [line for line in job_stderr.splitlines() if line.startswith("parallel3d: error:") and words in line]
    assert len(lines) == 1, job_stderr[-3000:]
    return lines[0]


@pytest.mark.multirank
def test_the_faults_of_fault_tolerance_each_end_in_one_line(tmp_path):
    """One-process groups: a lighthouse nobody started; then under a live lighthouse, beside a group
    training, a second group with its replica id and one with another model, each refused; then
    the lighthouse killed mid-run: the group stops within its timeouts. Each says so in one line."""
    from ft_cluster import Job, free_port, group_job, membership, start_lighthouse, wait_for

    base = ["train.steps=1000", "optim.warmup_steps=2", "train.seq_len=32", "train.global_batch_size=4",
            "ft.enabled=true", "ft.timeout_s=5", "ft.quorum_timeout_s=5", "ft.connect_timeout_s=2",
            "checkpoint.every=5", "debug.ft_alone_sleep_s=0.3"]
    nobody = group_job(tmp_path, 0, [*base, f"ft.lighthouse=http://localhost:{free_port()}"], nproc=1,
                       name="nobody").start()
    lighthouse, address = start_lighthouse(tmp_path)
    jobs: list[Job] = [nobody, lighthouse]
    try:
        live = group_job(tmp_path, 0, [*base, f"ft.lighthouse={address}"], nproc=1, name="live").start()
        jobs.append(live)
        assert nobody.wait(120) != 0
        _one_line(nobody.stderr, "no lighthouse answers")
        wait_for(lambda: len(membership(tmp_path / "live")) >= 2, 180, lambda: live.stderr[-3000:])
        for name, replica_id, extra, words in [("twin", 0, [], "another live replica group has this id"),
                                               ("other", 1, ["model.n_layers=2"], "trains another config")]:
            intruder = group_job(tmp_path, replica_id, [*base, f"ft.lighthouse={address}", *extra], nproc=1,
                                 name=name).start()
            jobs.append(intruder)
            assert intruder.wait(180) != 0
            _one_line(intruder.stderr, words)
        committed = len(membership(tmp_path / "live"))
        wait_for(lambda: len(membership(tmp_path / "live")) > committed, 60, lambda: live.stderr[-3000:])
        lighthouse.kill()
        killed_at = time.time()
        assert live.wait(120) != 0
        assert time.time() - killed_at < 5 + 5 + 30  # its quorum and collective timeouts, and exiting
    finally:
        for job in jobs:
            if job.proc is not None and job.proc.poll() is None:
                job.kill()
    _one_line(live.stderr, "lost the lighthouse")
    last = membership(tmp_path / "live")[-1]["step"]
    complete = (tmp_path / "live" / "checkpoints").glob("step_*/COMPLETE")
    saved = sorted(int(p.parent.name.split("_")[1]) for p in complete)
    assert saved and saved[-1] <= last  # every checkpoint a committed step's


def test_the_planner_and_the_dry_run_count_the_cross_group_traffic():
    """Each rank all-reduces its gradient shard with the other groups once a step: the planner's
    bytes and the dry run's (the real step's gradients, counted) agree, and are absent without ft."""
    from parallel3d.planner import predict
    from parallel3d.planner.dryrun import run_rank

    c = OmegaConf.to_object(check(compose(["run_dir=/nonexistent", *FT, "parallel.dp_shard=2"]), 2))
    planned = predict(c, 2).comm_bytes["ft"]["all_reduce"]
    counted = run_rank(c, 2, 0).comm["ft"]["all_reduce"]
    assert counted.group_size == 2 and counted.calls == 1
    assert counted.sent_bytes == pytest.approx(planned + 4, rel=1e-9)  # + the loss, a float32 scalar
    plain = OmegaConf.to_object(check(compose(["run_dir=/nonexistent", "parallel.dp_shard=2"]), 2))
    assert "ft" not in predict(plain, 2).comm_bytes
    diloco = OmegaConf.to_object(check(compose(["run_dir=/nonexistent", *FT, "parallel.dp_shard=2", "train.steps=40",
                                                "ft.semi_sync=diloco", "ft.diloco.inner_steps=4"]), 2))
    every_fourth = predict(diloco, 2).comm_bytes["ft"]["all_reduce"]
    assert every_fourth == pytest.approx(planned / 4)  # float32 pseudo-gradients, a quarter of the steps
    assert run_rank(diloco, 2, 0).comm["ft"]["all_reduce"].sent_bytes == pytest.approx(every_fourth, rel=1e-9)


@pytest.mark.multirank
def test_diloco_groups_sync_every_inner_steps_as_one_process_simulates_them(tmp_path):
    """ft.semi_sync=diloco with pipeline parallelism inside each group: two groups of 2 ranks (pp=2)
    train 3 local steps each, then average their pseudo-gradients into an outer Nesterov step,
    twice. The first sync fails on group 1's side: both go back to the period's start and train it
    again. Both end bitwise equal, and equal to one process simulating the two replicas
    (parallel3d.ft.replay.replay_diloco) within 1e-6."""
    from harness.runs import final_weights
    from ft_cluster import group_job, membership, start_lighthouse

    from parallel3d.checkpoint.checkpointer import full_model_state
    from parallel3d.hf.export import save_run_model

    lighthouse, address = start_lighthouse(tmp_path, min_replicas=2)  # the first sync waits for both
    common = ["train.steps=6", "optim.warmup_steps=2", "train.seq_len=32", "train.global_batch_size=8",
              "optim.eps=1e-6", "ft.enabled=true", f"ft.lighthouse={address}", "ft.replicas=2",
              "ft.semi_sync=diloco", "ft.diloco.inner_steps=3", "train.save_model=true"]
    fail = {0: [], 1: ["debug.ft_fail_steps=[3]"]}  # group 1's side of the first sync fails: both redo the period
    groups = [group_job(tmp_path, r, [*common, "parallel.pp=2", *fail[r]], nproc=2).start() for r in (0, 1)]
    try:
        assert [g.wait(300) for g in groups] == [0, 0], groups[0].stderr[-3000:] + groups[1].stderr[-3000:]
    finally:
        for job in [lighthouse, *groups]:
            if job.proc.poll() is None:
                job.kill()
    logs = [tmp_path / f"group{g}" / "ft" / "membership.jsonl" for g in (0, 1)]
    c = OmegaConf.to_object(check(compose([f"run_dir={tmp_path / 'sim'}", *common]), 1))
    with one_torch_thread():
        simulated = replay_diloco(c, logs)
    (tmp_path / "sim").mkdir()
    save_run_model(tmp_path / "sim", full_model_state(simulated[0].parts, None), model_cfg=c.model,
                   tokenizer=c.data.tokenizer)
    weights, other, expected = (final_weights(tmp_path / name) for name in ("group0", "group1", "sim"))
    assert all(torch.equal(weights[k], other[k]) for k in weights)
    assert max((weights[k] - expected[k]).abs().max().item() for k in weights) <= 1e-6
    chain = read_membership(logs)
    assert list(chain) == list(range(1, 7)) and all(e["trained_slices"] == [0, 1] for e in chain.values())
    dropped = [e["step"] for e in membership(tmp_path / "group0") if not e["trained_slices"]]
    assert dropped == [1, 2, 3]  # the failed sync's period, logged dropped, then trained again


@pytest.mark.fast
def test_the_lighthouse_serves_at_the_address_it_gives_and_its_absence_is_one_line(capsys):
    from parallel3d.cli.lighthouse import main
    from parallel3d.ft import FTError
    from parallel3d.ft.lighthouse import check_reachable, start_lighthouse

    assert main(["--min-replicas", "0"]) == 2
    assert "--min-replicas=0: must be >= 1" in capsys.readouterr().err
    server = start_lighthouse(min_replicas=1, port=0, join_timeout_ms=100, heartbeat_timeout_ms=1000,
                              quorum_tick_ms=100)
    try:
        check_reachable(server.address(), timeout_s=5)  # something answers there
    finally:
        server.shutdown()
    from ft_cluster import free_port

    with pytest.raises(FTError, match=r"ft.lighthouse=http://.*: no lighthouse answers") as refused:
        check_reachable(f"http://localhost:{free_port()}", timeout_s=2)
    assert "\n" not in str(refused.value) and "parallel3d-lighthouse --min-replicas N --port P" in str(refused.value)


@pytest.mark.multirank
def test_after_a_lighthouse_restart_the_groups_resume_and_the_log_still_replays(tmp_path):
    """One-rank groups; the lighthouse is SIGKILLed mid-run: both groups stop in one line each. It
    is started again at the same address, and both groups with their same commands: group 0 resumes
    from its checkpoint (only it writes them), group 1 from nothing, and whichever is behind heals.
    The steps after the checkpoint are trained again; the log's lineage drops the undone ones, and
    one process replaying it ends with both groups' (equal) weights within 1e-6."""
    from harness.runs import final_weights
    from ft_cluster import free_port, group_job, membership, start_lighthouse, wait_for

    port = free_port()
    lighthouse, address = start_lighthouse(tmp_path, port=port)
    common = [*_group_config(address, steps=16), "train.seq_len=32", "train.global_batch_size=8",
              "checkpoint.every=4", "ft.quorum_timeout_s=60", "ft.timeout_s=5"]
    groups = [group_job(tmp_path, g, common, nproc=1) for g in (0, 1)]
    jobs = [lighthouse, *groups]
    try:
        for g in groups:
            g.start()
        def past_a_checkpoint():  # together, and a step or two after group 0's last checkpoint
            log = membership(tmp_path / "group0")
            return sum(e["participants"] == [0, 1] for e in log) >= 4 and log[-1]["step"] % 4 in (1, 2)

        wait_for(past_a_checkpoint, 300, lambda: groups[0].stderr[-3000:])
        lighthouse.kill()
        assert [g.wait(120) != 0 for g in groups] == [True, True]
        for g in groups:
            _one_line(g.stderr, "lost the lighthouse")
        restarted_at = time.time()
        lighthouse, again = start_lighthouse(tmp_path, port=port, name="lighthouse-again")
        jobs.append(lighthouse)
        assert again == address
        for g in groups:
            g.start()
        assert [g.wait(300) for g in groups] == [0, 0], groups[1].stderr[-3000:]
    finally:
        for job in jobs:
            if job.proc is not None and job.proc.poll() is None:
                job.kill()
    resumed = re.search(r"resumed from \S+/step_(\d+)", groups[0].stdout)
    assert resumed and "parallel3d: ft: healed" in groups[0].stdout + groups[1].stdout
    logs = [tmp_path / f"group{g}" / "ft" / "membership.jsonl" for g in (0, 1)]
    chain = read_membership(logs)
    assert list(chain) == list(range(1, 17))
    before = max(e["step"] for e in membership(tmp_path / "group0") if e["time"] < restarted_at)
    undone = range(int(resumed.group(1)) + 1, before + 1)  # committed, then undone by the restart
    assert all(chain[step]["time"] > restarted_at for step in undone)  # the lineage takes their new lines
    weights = final_weights(tmp_path / "group0")
    assert all(torch.equal(weights[k], v) for k, v in final_weights(tmp_path / "group1").items())
    replayed = _replayed_weights(common, logs, tmp_path / "replay")
    assert max((weights[k] - replayed[k]).abs().max().item() for k in weights) <= 1e-6
