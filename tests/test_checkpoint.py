"""Checkpoints: exact resume, resharding to other layouts, atomicity, seed checkpoints.

Launched runs save at one layout (``checkpoint.every=3`` over the parity runs' 6 steps) and continue
from step 3 at another; steps 4-6 and the final weights must match the single-process run that never
stopped (the parity reference) within the tolerance its own sensitivity implies
(tests/harness/tolerance.py). Same-layout resumes must match their own uninterrupted run bit for
bit. The in-process tests cover the checkpoint folder itself.
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness.parity import FULL_3D, PARITY_STEPS, SAVE_EVERY, SAVING, assert_matches
from harness.runs import FAST, Run, launch, launch_batch, relative_error
from harness.shared_runs import shared_runs
from harness.store import RunStore
from harness.tolerance import Tolerance

import parallel3d.checkpoint.checkpointer as checkpoint_module
import parallel3d.checkpoint.commit as commit_module
import parallel3d.checkpoint.manifest as manifest_module
from parallel3d.base import RunError
from parallel3d.checkpoint.checkpointer import Checkpointer
from parallel3d.checkpoint.commit import COMPLETE, META, complete_steps, find_checkpoint
from parallel3d.checkpoint.errors import CheckpointError
from parallel3d.checkpoint.manifest import MANIFEST, read_manifest
from parallel3d.checkpoint.resume import pick_checkpoint
from parallel3d.checkpoint.state import TrainState
from parallel3d.checkpoint.unfinished import settle_unfinished
from parallel3d.config.schema import CheckpointConfig, ModelConfig, OptimConfig
from parallel3d.models import Transformer
from parallel3d.optim.schedule import build_lr_scheduler

SAVE = SAVING  # what the saving runs train, also read by tests/test_launch_multinode.py
DP2_TP2 = ["parallel.dp_shard=2", "parallel.tp=2"]
INIT_STD = [*FAST, f"train.steps={PARITY_STEPS}", "model.init_std=0.05"]  # the seed test's direct run


class Saved:
    """Runs that save checkpoints, from the session's run store (tests/harness/store.py: trained once,
    whichever file asks first), and their resumes; ``root`` for this module's own launches."""

    def __init__(self, store: RunStore, root: Path):
        self.store, self.root, self.runs = store, root, {}
        root.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, nproc: int, overrides: list[str]) -> Run:
        if name not in self.runs:
            self.prefetch({name: (nproc, [*SAVE, *overrides])})
        self.runs[name].assert_finished(PARITY_STEPS)
        return self.runs[name]

    def resume(self, name: str, source: Run, nproc: int, overrides: list[str], step: int = SAVE_EVERY) -> Run:
        if name not in self.runs:
            self.prefetch({name: (nproc, self.resume_arguments(source, overrides, step))})
        run = self.runs[name]
        run.assert_finished(PARITY_STEPS)
        assert [row["step"] for row in run.metrics] == list(range(step + 1, PARITY_STEPS + 1)), run.stdout[-2000:]
        return run

    @staticmethod
    def resume_arguments(source: Run, overrides: list[str], step: int = SAVE_EVERY) -> list[str]:
        path = source.run_dir / "checkpoints" / f"step_{step}"
        return [*FAST, f"train.steps={PARITY_STEPS}", f"checkpoint.resume={path}", "train.save_model=true", *overrides]

    def prefetch(self, runs: dict[str, tuple[int, list[str]]]) -> None:
        """These (name: ranks, full overrides), a few per launch (runs another file trained are read)."""
        self.runs |= {name: Run.from_record(record) for name, record in self.store.get(runs).items()}


def selected_here(session) -> list:
    """This file's tests that the session will run (after -k, --lf, ...)."""
    return [item for item in session.items if getattr(getattr(item, "module", None), "__name__", "") == __name__]


def selected_reshards(session) -> list[tuple]:
    """RESHARDS' rows of the selected tests, and the dp2 x tp2 resume at its own layout if selected."""
    mine = selected_here(session)
    wanted = {getattr(getattr(item, "callspec", None), "params", {}).get("name") for item in mine}
    reshards = [r for r in RESHARDS if r[0] in wanted]
    if any(item.name == "test_resume_at_the_same_layout_dp2_tp2" for item in mine):
        reshards.append(("dp2-tp2-again", ("dp2-tp2", 4, DP2_TP2), (4, DP2_TP2)))
    return reshards


def shared_runs_of(session) -> dict[str, tuple[int, list[str]]]:
    """The saving runs the selected tests resume, and the seed test's one-process run: independent
    runs, so they train in launches shared with other files' runs of their rank counts
    (tests/harness/shared_runs.py)."""
    # Not the 8-rank run: no other file shares its rank count, so it would gain nothing and make
    # whichever file asked first wait for it (the saved fixture asks for it on its own).
    runs = {source: (n, [*SAVE, *o]) for _, (source, n, o), _ in selected_reshards(session) if n < 8}
    if any(item.name == "test_seed_checkpoint_starts_any_layout" for item in selected_here(session)):
        runs["init-std"] = (1, INIT_STD)
    return runs


@pytest.fixture(scope="module")
def saved(run_store, runs_root, request) -> Saved:
    """The selected tests' saving runs train first, then their resumes: a few launches for all."""
    saved = Saved(run_store, runs_root / "checkpoints")
    reshards = selected_reshards(request.session)
    saved.runs |= shared_runs(run_store, request.session, request.module)
    saved.prefetch({source: (n, [*SAVE, *o]) for _, (source, n, o), _ in reshards if source not in saved.runs})
    saved.prefetch({name: (n, saved.resume_arguments(saved.runs[source], o)) for name, (source, *_), (n, o) in reshards
                    if saved.runs[source].returncode == 0})
    return saved


def assert_continues(run: Run, source: Run, reference: Run | None = None, tolerance: Tolerance | float = 0.0) -> None:
    """Steps after the resume equal those of ``source``, the uninterrupted run that wrote the
    checkpoint, and of the single-process ``reference``; the final weights equal ``source``'s.
    ``tolerance``: 0 where the resume continues at the layout that saved (the same float32
    operations in the same order: bit for bit); where it continues at another layout, the one the
    reference's own sensitivity implies (tests/harness/tolerance.py)."""
    steps = [row["step"] for row in run.metrics]
    for other in (source, reference):
        if other is None:
            continue
        assert_matches(other, run, tolerance=tolerance, metrics=("loss", "grad_norm"))
        ref = {row["step"]: row for row in other.metrics}
        assert relative_error([r["lr"] for r in run.metrics], [ref[s]["lr"] for s in steps]) < 1e-12
    assert_matches(source, run, tolerance=tolerance, metrics=(), weights=True)


# -- same layout --------------------------------------------------------------------------


def test_auto_resume_continues_exactly(saved):
    """A run killed after step 4 restarts in its run_dir, resumes from step 3, ends identical."""
    whole = saved.run("single", 1, [])
    resumed_dir = saved.root / "single-resumed"
    shutil.copytree(whole.run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / f"step_{PARITY_STEPS}")
    rows = (resumed_dir / "metrics.jsonl").read_text().splitlines()
    (resumed_dir / "metrics.jsonl").write_text("\n".join(rows[:4]) + "\n")  # it had logged step 4
    run = launch(resumed_dir, [*SAVE])
    run.assert_finished(PARITY_STEPS)
    assert "resumed from" in run.stdout and f"step_{SAVE_EVERY}" in run.stdout
    assert [row["step"] for row in run.metrics] == list(range(1, PARITY_STEPS + 1))  # one row per step, none repeated
    assert_matches(whole, run, tolerance=0.0)  # the same operations in the same order: bit for bit
    assert complete_steps(resumed_dir / "checkpoints") == [SAVE_EVERY, PARITY_STEPS]


@pytest.mark.multirank
def test_resume_at_the_same_layout_dp2_tp2(saved):
    whole = saved.run("dp2-tp2", 4, DP2_TP2)
    assert_continues(saved.resume("dp2-tp2-again", whole, 4, DP2_TP2), whole, tolerance=0.0)


def test_resume_none_starts_afresh(saved):
    whole = saved.run("single", 1, [])
    run_dir = saved.root / "single-none"
    shutil.copytree(whole.run_dir, run_dir)
    run = launch(run_dir, [*FAST, "checkpoint.resume=none", "train.steps=2"])
    run.assert_finished(2)
    assert "resumed" not in run.stdout
    assert [row["step"] for row in run.metrics] == [1, 2]
    assert run.losses[0] == whole.losses[0]  # the first step again, bit for bit


# -- resharding ---------------------------------------------------------------------------


# (test id, saved at: name, ranks, overrides; continued at: ranks, overrides)
RESHARDS = [
    # The data position carries over although each dp rank now reads another slice.
    ("dp2-tp2-to-dp4", ("dp2-tp2", 4, DP2_TP2), (4, ["parallel.dp_shard=4"])),
    # ZeRO-1 under tp saves optimizer rows of tp shards, described in the parameter's layout.
    ("3d-zero1-to-single", ("3d-zero1", 8, [*FULL_3D, "parallel.zero_stage=1"]), (1, [])),
    ("single-to-zero1-tp2", ("single", 1, []), (4, [*DP2_TP2, "parallel.zero_stage=1"])),
    ("pp2-to-interleaved", ("pp2", 2, ["parallel.pp=2"]),
     (2, ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"])),
    # checkpoint.async_save writes while training goes on; what it wrote is that step's state.
    ("zero3-async-to-zero1", ("dp2-zero3-async", 2, ["parallel.dp_shard=2", "checkpoint.async_save=true"]),
     (2, ["parallel.dp_shard=2", "parallel.zero_stage=1"])),
    ("tp2-to-pp2-tp2", ("tp2", 2, ["parallel.tp=2"]), (4, ["parallel.tp=2", "parallel.pp=2"])),
    # ZBV puts both copies of a tied embedding on one rank; they load into one matrix under tp.
    ("tied-zbv-to-tp2", ("tied-zbv", 2, ["model.tie_embeddings=true", "parallel.pp=2",
                                          "parallel.pp_schedule=ZBVZeroBubble", "parallel.zero_stage=2"]),
     (2, ["model.tie_embeddings=true", "parallel.tp=2"])),
]


@pytest.mark.multirank
@pytest.mark.parametrize("name,saved_at,continued_at", RESHARDS, ids=[r[0] for r in RESHARDS])
def test_reshard(saved, parity, name, saved_at, continued_at):
    source = saved.run(*saved_at)
    assert complete_steps(source.run_dir / "checkpoints") == [SAVE_EVERY, PARITY_STEPS]
    run = saved.resume(name, source, *continued_at)
    tied = "model.tie_embeddings=true" in saved_at[2]
    assert_continues(run, source, parity.reference(tied=tied), parity.tolerance(tied=tied))


# -- seed checkpoint ----------------------------------------------------------------------


@pytest.mark.multirank
def test_seed_checkpoint_starts_any_layout(saved, parity):
    """Weights initialized once (here with another init_std) start a run at another layout."""
    step0 = saved.root / "seed" / "checkpoints" / "step_0"
    steps = f"train.steps={PARITY_STEPS}"  # the parity family's tolerance: its steps
    # One 2-rank launch for both: the seed's layout ends before the one that starts from it
    # (tests/harness/layout_batch.py); one that failed there, launched again on its own.
    layouts = {"seed": [*FAST, "checkpoint.create_seed=true", "model.init_std=0.05", "parallel.dp_shard=2"],
               "from-seed": [*FAST, steps, f"checkpoint.init_from={step0}", "parallel.tp=2"]}
    runs = launch_batch(saved.root, layouts, nproc=2)
    for name, overrides in layouts.items():
        if name not in runs:
            runs[name] = launch(saved.root / name, overrides, nproc=2)
    seed_run, from_seed = runs["seed"], runs["from-seed"]
    assert (step0 / COMPLETE).is_file(), seed_run.stderr[-2000:]
    assert json.loads((step0 / "meta.json").read_text())["model_only"]
    assert not seed_run.metrics  # it trains nothing
    from_seed.assert_finished(PARITY_STEPS)
    direct = saved.runs["init-std"]  # the seed's init_std, trained from scratch in one process
    direct.assert_finished(PARITY_STEPS)
    # another layout: the default family's tolerance (the same model, data and optimizer)
    assert_matches(direct, from_seed, tolerance=parity.tolerance(), metrics=("loss",))


# -- the checkpoint folder ----------------------------------------------------------------


def _tiny_state(seed: int = 0) -> TrainState:
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                    max_seq_len=16))
    model.init_weights(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return TrainState([model], optimizer, build_lr_scheduler(optimizer, OptimConfig(warmup_steps=2), 10))


def _train_step(state: TrainState) -> None:
    tokens = torch.randint(0, 64, (2, 16))
    state.parts[0](tokens).sum().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad()


def _checkpointer(tmp_path: Path, **cfg) -> Checkpointer:
    return Checkpointer(tmp_path, CheckpointConfig(**cfg))


@pytest.mark.fast
def test_load_restores_model_optimizer_schedule_and_rng(tmp_path):
    saved = _tiny_state()
    for _ in range(3):
        _train_step(saved)
    ckpt = _checkpointer(tmp_path, every=1)
    ckpt.save(3, saved, {"samples_seen": 48}, "")
    expected_next = torch.rand(3)  # what the RNG gives right after the save

    loaded = _tiny_state(seed=1)  # other weights, no optimizer state yet
    torch.manual_seed(1234)
    meta = ckpt.load(tmp_path / "checkpoints" / "step_3", loaded)
    assert meta["step"] == 3 and meta["samples_seen"] == 48
    assert torch.equal(torch.rand(3), expected_next)
    for (name, a), (_, b) in zip(saved.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved.optimizer.state[a][key], loaded.optimizer.state[b][key]), (name, key)
    assert loaded.scheduler.last_epoch == 3
    assert loaded.optimizer.param_groups[0]["lr"] == saved.optimizer.param_groups[0]["lr"]


def test_checkpoint_holds_no_pickle_and_loads_without_unpickling(tmp_path, monkeypatch):
    state = _tiny_state()
    _train_step(state)
    ckpt = _checkpointer(tmp_path, every=1)
    ckpt.save(1, state, {"samples_seen": 16}, "train: {}\n")
    files = [p for p in (tmp_path / "checkpoints" / "step_1").rglob("*") if p.is_file()]
    assert {p.suffix for p in files} <= {".safetensors", ".json", ".yaml", ""}, files

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    ckpt.load(tmp_path / "checkpoints" / "step_1", _tiny_state(seed=1))


def _unfinished_copy(root: Path, step: int, *damage: str) -> Path:
    """A copy of step_2 as step_<step>, without its COMPLETE marker, damaged as ``damage`` says."""
    path = root / f"step_{step}"
    shutil.copytree(root / "step_2", path)
    (path / COMPLETE).unlink()
    for what in damage:
        if what == "truncate":
            shard = next(path.glob("shard-*.safetensors"))
            shard.write_bytes(shard.read_bytes()[:-4])
        elif what == "flip":
            shard = next(path.glob("shard-*.safetensors"))
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 1
            shard.write_bytes(bytes(data))
        elif what == "old meta":  # as a checkpoint saved before manifests existed
            meta = json.loads((path / META).read_text())
            del meta["manifest"]
            (path / META).write_text(json.dumps(meta))
        else:
            (path / what).unlink()
    return path


def test_folders_without_their_marker_are_restored_removed_or_set_aside(tmp_path, capsys):
    """Only what provably never finished is removed; a folder that verifies gets its marker back;
    anything else is set aside, and a start left with nothing to resume stops instead of starting afresh."""
    _checkpointer(tmp_path, every=1).save(2, _tiny_state(), {"samples_seen": 0}, "")
    root = tmp_path / "checkpoints"
    assert pick_checkpoint(root, "auto", announce=False) == root / "step_2"
    lost_marker = _unfinished_copy(root, 4)
    killed = [_unfinished_copy(root, 6, MANIFEST), _unfinished_copy(root, 8, MANIFEST, META)]
    damaged, old = _unfinished_copy(root, 10, "flip"), _unfinished_copy(root, 12, MANIFEST, "old meta")
    assert find_checkpoint(tmp_path) == root / "step_2"  # none of them is loaded as it is
    settle_unfinished(root=root, verify="checksum", resume="auto", announce=True)
    out, err = capsys.readouterr()
    assert complete_steps(root) == [2, 4] and (lost_marker / COMPLETE).is_file()
    assert f"restored the COMPLETE marker of {lost_marker}" in out
    assert not any(p.exists() for p in killed) and all(f"removed incomplete checkpoint {p}" in out for p in killed)
    aside = tmp_path / "set-aside"
    assert sorted(p.name for p in aside.iterdir()) == ["step_10", "step_12"] and not damaged.exists()
    assert f"{damaged} has no COMPLETE marker and does not verify" in err and "checksum mismatch" in err
    assert f"{old} has no COMPLETE marker and no manifest.json" in err and f"set aside to {aside / 'step_12'}" in err
    first_save_killed = tmp_path / "other" / "checkpoints"
    shutil.copytree(killed_source := _unfinished_copy(root, 16, MANIFEST), first_save_killed / "step_16")
    shutil.rmtree(killed_source)
    settle_unfinished(root=first_save_killed, verify="checksum", resume="auto", announce=True)
    assert f"no checkpoint in {first_save_killed} had finished: starting from step 1" in capsys.readouterr().out
    _unfinished_copy(root, 14, "truncate")
    for step in (2, 4):  # every marker gone: the intact folders come back, the damaged one is set aside
        (root / f"step_{step}" / COMPLETE).unlink()
    settle_unfinished(root=root, verify="none", resume="auto", announce=False)  # still checks the sizes
    assert complete_steps(root) == [2, 4] and (aside / "step_14").is_dir()
    for step in (2, 4):  # nothing left that verifies: a stop in one line, never a fresh start
        (root / f"step_{step}" / COMPLETE).unlink()
        (root / f"step_{step}" / "config.yaml").write_text("edited: true\n")
    with pytest.raises(CheckpointError, match=rf"no complete checkpoint is left in {root} \(2 set aside: .*"
                                              r"Fix: check that folder .*checkpoint.resume=none to start afresh"):
        settle_unfinished(root=root, verify="size", resume="auto", announce=False)


def test_keep_last_prunes_older_checkpoints_marker_first(tmp_path, monkeypatch):
    """A kill while an old checkpoint's files are deleted must leave no COMPLETE behind them."""
    removed, rmtree = [], shutil.rmtree

    def recorded(path, *args, **kwargs):
        if Path(path).exists():
            removed.append((Path(path).name, (Path(path) / COMPLETE).exists()))
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", recorded)
    state = _tiny_state()
    ckpt = _checkpointer(tmp_path, every=1, keep_last=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, state, {"samples_seen": 0}, "")
    assert complete_steps(tmp_path / "checkpoints") == [3, 4]
    assert removed == [("step_1", False), ("step_2", False)]


def _saves_on_two_ranks(rank: int, folder: Path) -> None:
    """One of two gloo processes of the test below: a sync save, an async one, an async one whose
    commit fails on rank 0 alone, then a resume's verification. Writes what it saw to rank<r>.json."""
    dist.init_process_group("gloo", init_method=f"file://{folder / 'store'}", rank=rank, world_size=2)
    hashed, verified = {}, []
    own_entries, hash_blocks = checkpoint_module.file_entries, manifest_module._hash_blocks
    checkpoint_module.file_entries = lambda path, files: (
        hashed.setdefault(path.name, []).extend(Path(f).relative_to(path).as_posix() for f in files)
        or own_entries(path, files))
    manifest_module._hash_blocks = lambda path, blocks, block: verified.extend(blocks) or hash_blocks(path, blocks, block)
    state = TrainState([torch.nn.ModuleDict({f"rank{rank}": torch.nn.Linear(4, 4)})])  # each rank its own keys
    Checkpointer(folder, CheckpointConfig(keep_last=0)).save(1, state, {"samples_seen": 0}, "")
    ckpt = Checkpointer(folder, CheckpointConfig(keep_last=0, async_save=True))
    polls, error = 0, None
    for step in (2, 3):
        if step == 3 and rank == 0:  # rank 0's meta.json write fails: rank 1's commit has nothing to fail
            commit_module.write_atomic = lambda path, text: (_ for _ in ()).throw(OSError(5, "injected", path))
        ckpt.save(step, state, {"samples_seen": 0}, "")
        try:
            while ckpt._pending is not None:
                ckpt.poll()
                polls += 1
        except CheckpointError as e:
            error = str(e)
    verified.clear()  # what the saves hashed: from here, what the resume's verification reads
    picked = pick_checkpoint(folder / "checkpoints", "auto", announce=False)
    (folder / f"rank{rank}.json").write_text(json.dumps({"hashed": hashed, "verified": verified, "polls": polls,
                                                         "error": error, "picked": str(picked)}))
    dist.destroy_process_group()


@pytest.mark.multirank
def test_each_rank_hashes_its_own_files_and_verifies_its_share(tmp_path):
    """Two processes: each rank hashes exactly the files it wrote (sync and async), a failed async
    commit raises the same line on both ranks at the same step, and each block is verified once."""
    procs = [multiprocessing.get_context("spawn").Process(target=_saves_on_two_ranks, args=(r, tmp_path))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for step in ("step_1", "step_2"):
        listed = set(read_manifest(tmp_path / "checkpoints" / step)["files"])
        for r in (0, 1):
            own = seen[r]["hashed"][step]
            assert own[0] == f"rng/rank_{r}.safetensors" and own[1].startswith(f"shard-{r + 1:05d}-") and len(own) == 2
        assert listed == {*seen[0]["hashed"][step], *seen[1]["hashed"][step], "meta.json", "config.yaml"}
    assert seen[0]["polls"] == seen[1]["polls"]
    assert seen[0]["error"] == seen[1]["error"] and "injected" in seen[0]["error"]
    assert seen[0]["picked"] == seen[1]["picked"] == str(tmp_path / "checkpoints" / "step_2")
    assert not (tmp_path / "checkpoints" / "step_3").exists()
    verified = [tuple(b) for s in seen for b in s["verified"]]
    assert seen[0]["verified"] and seen[1]["verified"] and len(verified) == len(set(verified)) == len(listed)


def test_resume_takes_a_step_folder_a_checkpoints_folder_or_a_run_dir(tmp_path):
    state = _tiny_state()
    _checkpointer(tmp_path / "run", every=1).save(3, state, {"samples_seen": 0}, "")
    step3 = tmp_path / "run" / "checkpoints" / "step_3"
    for given in (step3, step3.parent, tmp_path / "run"):
        assert pick_checkpoint(tmp_path / "other" / "checkpoints", str(given), announce=False) == step3
    assert pick_checkpoint(step3.parent, "none", announce=False) is None
    with pytest.raises(RunError, match="no complete checkpoint"):
        pick_checkpoint(tmp_path / "other" / "checkpoints", str(tmp_path / "missing"), announce=False)


@pytest.mark.fast
def test_optimizer_state_is_named_by_parameter_whatever_the_group_order():
    """AdamW's no-decay group (the norms) comes after the decay group, unlike the model's order:
    each saved moment must still carry its own parameter's name and shape."""
    from parallel3d.checkpoint.state import state_dict
    from parallel3d.optim.adamw import build_optimizer, init_optimizer_state

    model = Transformer(ModelConfig(n_layers=2))
    optimizer = build_optimizer(model, OptimConfig())
    assert len(optimizer.param_groups) == 2
    init_optimizer_state(optimizer)
    saved = state_dict(TrainState([model], optimizer))
    for name, p in model.named_parameters():
        assert saved[f"optimizer/{name}/exp_avg"].shape == p.shape
        assert saved[f"optimizer/{name}/exp_avg"] is optimizer.state[p]["exp_avg"]
