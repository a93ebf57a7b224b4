"""Shared harness: launch real training runs and judge them by what they wrote.

Runs go through ``python -m parallel3d.train`` (one process) or ``torchrun`` (several gloo ranks
on CPU) in subprocesses with timeouts. A run is judged by its metrics.jsonl, not only torchrun's
exit code: gloo occasionally aborts a worker at exit after the run has finished (see NOTES).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from parity_tolerance import Tolerance, log_comparison, measure, metric_spread, twins, weight_spread
from process_guard import torchrun_only_in_multirank_tests  # noqa: F401  (a session fixture: see there)
from run_store import RunStore, run_key, shared_root

RUN_TIMEOUT_S = 300
BATCH_TIMEOUT_S = 120
BATCH_SIZE = 8  # layouts per launch: bounds what one failure sends back to launches of their own
# Every test run: a short, fast variant of the default recipe.
# optim.eps=1e-6: AdamW's update m/sqrt(v) ignores the gradient's scale, so with eps=1e-8 an element
# whose gradient is pure round-off (~1e-10) still moves by up to lr per step, in a direction the
# round-off picks: after 10 steps one element of layers.1.attention.wv differed by 2.9e-5 between
# tied layouts whose losses agreed to 2e-7. eps=1e-6 damps such elements, so the final weights'
# sensitivity to round-off, and with it their derived tolerance (parity_tolerance.py), stays small.
STEPS = 10  # the FAST run's steps: a test that means "the last step" says STEPS
FAST = [f"train.steps={STEPS}", "optim.warmup_steps=2", "train.seq_len=64", "train.global_batch_size=16", "optim.eps=1e-6"]


@dataclass
class Run:
    run_dir: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.metrics]

    @classmethod
    def from_record(cls, record: dict) -> Run:
        """A run of tests/run_store.py's records."""
        return cls(Path(record["run_dir"]), record["returncode"], record["stdout"], record["stderr"])

    def record(self) -> dict:
        return {"run_dir": str(self.run_dir), "returncode": self.returncode, "stdout": self.stdout,
                "stderr": self.stderr}

    def assert_finished(self, steps: int) -> None:
        got = [row["step"] for row in self.metrics]
        assert got and got[-1] == steps, f"run stopped at {got[-1:]}, rc={self.returncode}\n{self.stderr[-3000:]}"


def env() -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    e.pop("RANK", None), e.pop("WORLD_SIZE", None), e.pop("LOCAL_RANK", None)
    return e


def launch(run_dir: Path, overrides: list[str], nproc: int = 1, launcher: str = "auto",
           timeout: int = RUN_TIMEOUT_S) -> Run:
    """Train with these overrides on ``nproc`` CPU ranks; wait for it (with a timeout)."""
    args = [f"run_dir={run_dir}", *overrides]
    if launcher == "auto":
        launcher = "python" if nproc == 1 else "torchrun"
    if launcher == "python":
        cmd = [sys.executable, "-m", "parallel3d.train", *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "parallel3d.train", *args]
    else:  # our launcher
        cmd = [sys.executable, "-m", "parallel3d.launch.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=run_dir.parent)
    return Run(run_dir, proc.returncode, proc.stdout, proc.stderr)


def refused_by_the_launcher(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """parallel3d-run in this process with a config it must refuse: (exit code, stderr). Starting
    torchrun instead (its os.execv, or a sweep's subprocess) fails the test."""
    from parallel3d.launch import run

    def started(*args, **kwargs):
        pytest.fail(f"the launcher started torchrun: {args}")

    monkeypatch.setattr(run.os, "execv", started)
    monkeypatch.setattr(run.subprocess, "run", started)
    with pytest.raises(SystemExit) as exited:
        run.main(argv)
    return exited.value.code, capsys.readouterr().err


def launch_batch(root: Path, layouts: dict[str, list[str]], nproc: int) -> dict[str, Run]:
    """Train ``layouts`` (name: overrides) one after another in one launch of tests/layout_batch.py,
    each into ``root/name``; returns the runs that succeeded on every rank. A failed layout ends the
    batch, so the caller launches it and any left over on their own (with that launch's errors)."""
    spec = root / f"batch-{'-'.join(layouts)[:80]}-{os.getpid()}.json"
    spec.write_text(json.dumps([{"run_dir": str(root / name), "overrides": o} for name, o in layouts.items()]))
    script = str(Path(__file__).with_name("layout_batch.py"))
    cmd = ([sys.executable, script] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script])
    try:
        subprocess.run([*cmd, str(spec)], capture_output=True, text=True, env=env(), cwd=root,
                       timeout=BATCH_TIMEOUT_S + RUN_TIMEOUT_S * len(layouts) // 3)
    except subprocess.TimeoutExpired:
        pass  # what finished before is kept; the rest run on their own
    runs = {}
    for name in layouts:
        results = [json.loads(p.read_text()) for p in sorted((root / f"{name}.batch").glob("rank*.json"))]
        log_layout_cpu(name, nproc, [r.get("cpu_s", 0.0) for r in results])
        if len(results) == nproc and all(r["returncode"] == 0 for r in results):
            runs[name] = Run(root / name, 0, results[0]["stdout"], results[0]["stderr"])
    return runs


def log_layout_cpu(name: str, nproc: int, cpu_s: list[float]) -> None:
    """``P3D_TEST_CPU_LOG=FILE``: also a line per layout trained in a batch, its ranks' CPU seconds
    summed (the launch's start-up apart), so that the cost of each layout of a matrix shows."""
    log = os.environ.get("P3D_TEST_CPU_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"layout": name, "nproc": nproc, "cpu_s": round(sum(cpu_s), 2)}) + "\n")


def launch_measured(root: Path, overrides: list[str], steps: int, name: str = "single",
                    **measure_args) -> tuple[Run, Tolerance]:
    """One process trains ``overrides`` into ``root/name`` and its twin (perturbed gradients,
    tests/parity_tolerance.py) beside it, in one launch; returns the run and the Tolerance the
    spread between the two implies (``measure_args``: parity_tolerance.measure's)."""
    runs = {name: overrides, **twins(name, overrides)}
    done = launch_batch(root, runs, nproc=1)
    for run_name, run_overrides in runs.items():
        if run_name not in done:  # failed in the batch: again on its own, with its own errors
            done[run_name] = launch(root / run_name, run_overrides)
        done[run_name].assert_finished(steps)
    return done[name], measure(done[name], *(done[twin] for twin in twins(name, overrides)), **measure_args)


@dataclass(frozen=True)
class Layout:
    """One layout of a parity matrix: ``nproc`` ranks train with ``overrides`` into the run named
    ``name``; ``tied``: with tied embeddings (compared with the tied one-process run)."""

    name: str
    nproc: int
    overrides: tuple[str, ...]
    tied: bool = False

    def __str__(self) -> str:  # the test id
        return self.name


def layouts(table: dict[str, tuple]) -> list[Layout]:
    """Layouts from a table ``{name: (ranks, overrides)}`` or ``{name: (ranks, overrides, tied)}``."""
    return [Layout(name, nproc, tuple(overrides), *tied) for name, (nproc, overrides, *tied) in table.items()]


def final_weights(run_dir: Path) -> dict:
    """What ``train.save_model=true`` wrote: the Hugging Face folder run_dir/hf/ (Hugging Face names)
    and a LoRA run's adapters (run_dir/hf_adapter/), or, for a model no Hugging Face family has,
    run_dir/model.safetensors (our names)."""
    from safetensors.torch import load_file

    files = sorted((run_dir / "hf").glob("*.safetensors")) or [run_dir / "model.safetensors"]
    files += sorted((run_dir / "hf_adapter").glob("*.safetensors"))
    return {key: tensor for path in files for key, tensor in load_file(str(path)).items()}


def assert_matches(reference: Run, run: Run, *, tolerance: Tolerance | float,
                   metrics: tuple[str, ...] = ("loss", "grad_norm"), weights: bool = False) -> None:
    """``run`` computed what ``reference`` did: each of ``metrics``, over the steps both logged,
    within relative ``tolerance``; with ``weights``, the final weights (``final_weights``) within
    it relative and absolute. A layout's ``tolerance`` is the one its reference's own sensitivity
    implies (tests/parity_tolerance.py: ``Parity.measured``); a plain number is for comparisons
    that are not round-off (float8 against bf16)."""
    def bound(key: str) -> tuple[float, str]:
        if isinstance(tolerance, Tolerance):
            return tolerance[key], tolerance.explain(key)
        return tolerance, f"tolerance {tolerance:g}"

    errors = {key: metric_spread(reference.metrics, run.metrics, key) for key in metrics}
    if weights:
        errors["weights"] = weight_spread(final_weights(reference.run_dir), final_weights(run.run_dir))
    log_comparison(reference, run, errors, tolerance)
    for key, error in errors.items():
        limit, why = bound(key)
        assert error <= limit, f"{run.run_dir.name} {key} {error:.3g} > {why}"


def selected_params(request, param: str = "name") -> set:
    """The values of ``param`` in this module's tests that pytest will run (after -k, --lf, ...)."""
    return {item.callspec.params[param] for item in request.session.items
            if item.module is request.module and param in getattr(getattr(item, "callspec", None), "params", {})}


def prefetch_selected(request, parity: Parity, layouts: list[Layout], param: str = "layout", prefix: str = "",
                      extra: list[str] = ()) -> None:
    """Batch the layouts of this module's tests that will run (those whose ``param``, a Layout or
    its name, is selected); the runs are named ``prefix + name`` with ``extra`` overrides first."""
    wanted = {str(value) for value in selected_params(request, param)}
    parity.prefetch({prefix + layout.name: (layout.nproc, [*extra, *layout.overrides])
                     for layout in layouts if layout.name in wanted})


# The files that take longest, by CPU seconds on a quiet run (P3D_TEST_CPU_LOG), the most first.
# pytest-xdist hands whole files to its workers in collection order: started first, none of them is
# left running alone at the end.
LONGEST_FIRST = ("test_checkpoint.py", "test_dryrun.py", "test_parallel_pipeline.py", "test_parallel_expert.py",
                 "test_parallel_pipeline_zero.py", "test_recovery.py", "test_train.py", "test_parallel_tensor.py",
                 "test_ft.py", "test_launch_multinode.py", "test_precision.py", "test_parallel_context.py",
                 "test_evaluate.py", "test_parallel_activation.py", "test_parallel_data.py", "test_hf_finetune.py",
                 "test_lora.py",
                 "test_planner_activations.py", "test_parallel_mla.py", "test_checkpoint_failures.py",
                 "test_parallel_float8.py", "test_muon.py", "test_data_corpus.py", "test_guard.py", "test_hf.py",
                 "test_faults.py", "test_benchmarks.py", "test_validate.py", "test_observability.py",
                 "test_finetune.py")


def pytest_collection_modifyitems(items) -> None:
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the others keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``P3D_TEST_CPU_LOG=FILE``: append each test's CPU seconds (its own process and the torchrun
    jobs it waited for, module fixtures included where they first ran) as a JSON line. Unlike wall
    time it hardly changes with the machine's load: it is what the suite's budget is made of."""
    log = os.environ.get("P3D_TEST_CPU_LOG")
    if not log:
        return (yield)
    import resource

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    start = cpu()
    try:
        return (yield)
    finally:
        with open(log, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(cpu() - start, 2)}) + "\n")


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core, at most 4 (a worker's jobs start up to 8 ranks each)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def relative_error(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A test that leaves the default process group up fails here, not the in-process tests after it
    (which could not start their own: "trying to initialize the default process group twice")."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left the default process group initialized: destroy it where it was created")


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


class Parity:
    """Runs layouts once each and compares them with the single-process run of the same model.
    The runs come from the session's RunStore: a layout any file of the session already trained
    (in any xdist worker) is read, not trained again."""

    def __init__(self, store: RunStore):
        self.store, self.runs, self.checked, self.tolerances = store, {}, set(), {}
        self.root = store.root  # where a test launches runs of its own (names of its own)

    def run_dir(self, name: str, nproc: int, overrides: list[str]) -> Path:
        """Where the run ``run`` gives for these would be, before it trains (a later run in the
        same batch resumes from its checkpoint)."""
        key = run_key(nproc, self.arguments(overrides))
        record = self.store.record(key)
        return Path(record["run_dir"]) if record else self.store.run_dir(name, key)

    def run(self, name: str, nproc: int, overrides: list[str]) -> Run:
        arguments = self.arguments(overrides)
        key = run_key(nproc, arguments)
        if key not in self.runs:
            self.runs[key] = Run.from_record(self.store.get({name: (nproc, arguments)})[name])
        run = self.runs[key]
        if key not in self.checked:
            run.assert_finished(STEPS)
            self.assert_planned_model_state(run, arguments, nproc)
            self.checked.add(key)
        return run

    def train(self, layout: Layout, prefix: str = "", extra: list[str] = ()) -> Run:
        """``layout``'s run (named ``prefix + name``, ``extra`` overrides first), checked as ``run`` does."""
        return self.run(prefix + layout.name, layout.nproc, [*extra, *layout.overrides])

    def prefetch(self, layouts: dict[str, tuple[int, list[str]]]) -> None:
        """Train the layouts no test of the session ran yet, a few per launch (tests/run_store.py);
        ``run`` then reads them."""
        wanted = {name: (n, self.arguments(o)) for name, (n, o) in layouts.items()}
        records = self.store.get({name: spec for name, spec in wanted.items() if run_key(*spec) not in self.runs})
        self.runs |= {run_key(*wanted[name]): Run.from_record(record) for name, record in records.items()}

    @staticmethod
    def arguments(overrides: list[str]) -> list[str]:
        return [*FAST, *overrides, "train.save_model=true"]

    @staticmethod
    def assert_planned_model_state(run: Run, overrides: list[str], nproc: int) -> None:
        """The planner's model-state bytes are exactly what the run measured on its largest rank."""
        from parallel3d.config.compose import compose
        from parallel3d.planner import predict

        planned = predict(compose(overrides), nproc).model_state_bytes
        measured = {key: run.metrics[-1][key] for key in planned}
        assert planned == measured, f"planner {planned} != run {measured} ({' '.join(overrides)}, {nproc} ranks)"

    def measured(self, name: str, overrides: list[str], **measure_args) -> tuple[Run, Tolerance]:
        """The one-process run ``name`` and the Tolerance its own sensitivity implies: it trains with
        its twins (perturbed gradients, tests/parity_tolerance.py) in one launch."""
        self.prefetch_references({name: overrides})
        reference = self.run(name, 1, overrides)
        perturbed = [self.run(twin, 1, o) for twin, o in twins(name, overrides).items()]
        key = (name, tuple(sorted(measure_args.items())))
        if key not in self.tolerances:
            self.tolerances[key] = measure(reference, *perturbed, **measure_args)
        return reference, self.tolerances[key]

    def prefetch_references(self, references: dict[str, list[str]], others: dict[str, list[str]] | None = None) -> None:
        """Train one-process references (name: overrides), each with its twins, and ``others``
        (one-process runs without a twin) in one launch."""
        runs = {run: o for name, overrides in references.items() for run, o in {name: overrides,
                                                                                 **twins(name, overrides)}.items()}
        self.prefetch({name: (1, overrides) for name, overrides in (runs | (others or {})).items()})

    def reference(self, tied: bool = False) -> Run:
        return self.measured(*self._reference(tied))[0]

    @staticmethod
    def _reference(tied: bool) -> tuple[str, list[str]]:
        return f"reference-tied{tied}", [f"model.tie_embeddings={tied}", "train.micro_batch_size=16"]

    def tolerance(self, tied: bool = False) -> Tolerance:
        """The default family's tolerances, for runs of the same model, data, optimizer and steps."""
        return self.measured(*self._reference(tied))[1]

    def assert_same_training(self, run: Run, tied: bool = False) -> None:
        """Per-step losses and grad norms, and the final weights, within the tolerances the
        reference's own sensitivity implies (tests/parity_tolerance.py)."""
        reference, tolerance = self.measured(*self._reference(tied))
        assert_matches(reference, run, tolerance=tolerance, weights=True)


def _batch_records(root: Path, layouts: dict[str, list[str]], nproc: int) -> dict[str, dict]:
    return {name: run.record() for name, run in launch_batch(root, layouts, nproc).items()}


def _one_record(run_dir: Path, overrides: list[str], nproc: int) -> dict:
    return launch(run_dir, overrides, nproc=nproc).record()


@pytest.fixture(scope="session")
def run_store(tmp_path_factory) -> RunStore:
    """The session's shared runs (tests/run_store.py), seen by every xdist worker."""
    return RunStore(shared_root(tmp_path_factory.getbasetemp()), _batch_records, _one_record, BATCH_SIZE)


@pytest.fixture(scope="session")
def parity(run_store) -> Parity:
    return Parity(run_store)


@pytest.fixture(scope="session")
def reference_run(parity) -> Run:
    """The single-process run every layout must reproduce (shared, run once)."""
    return parity.reference()


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


DESELECTED: list[str] = []  # tests/test_inventory.py: this session collected its items and these


def pytest_deselected(items) -> None:
    DESELECTED.extend(item.nodeid for item in items)
