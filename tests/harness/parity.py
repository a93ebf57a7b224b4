"""Parity matrices: layouts that must train as one process does, compared with the one-process
reference within the tolerance its own sensitivity implies (``tolerance.py``), their runs shared by
the whole session (``store.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.runs import FAST, Run, final_weights
from harness.store import RunStore, run_key
from harness.tolerance import Tolerance, log_comparison, measure, metric_spread, twins, weight_spread

# A parity run trains PARITY_STEPS steps of FAST: the warmup (2 steps), then the decay, with the
# optimizer's moments carried through every update; one that saves for a resume saves every
# SAVE_EVERY steps, so a resume from the middle continues for 3 steps. Steps are most of what a
# layout costs the suite (tools/suite_cpu.py --layouts); the tolerance is derived from the
# reference's own spread over the same steps (tolerance.py).
PARITY_STEPS = 6
SAVE_EVERY = 3
SAVING = [*FAST, f"train.steps={PARITY_STEPS}", f"checkpoint.every={SAVE_EVERY}", "train.save_model=true"]
# dp2 x tp2 x pp2 under 1F1B: a pipeline parity layout and a saved run that tests/test_checkpoint.py reshards
FULL_3D = ["parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=1F1B"]

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


def assert_matches(reference: Run, run: Run, *, tolerance: Tolerance | float,
                   metrics: tuple[str, ...] = ("loss", "grad_norm"), weights: bool = False) -> None:
    """``run`` computed what ``reference`` did: each of ``metrics``, over the steps both logged,
    within relative ``tolerance``; with ``weights``, the final weights (``final_weights``) within
    it relative and absolute. A layout's ``tolerance`` is the one its reference's own sensitivity
    implies (tests/harness/tolerance.py: ``Parity.measured``); a plain number is for comparisons
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


def selected_params(request, param: str = "name", module=None) -> set:
    """The values of ``param`` in ``module``'s tests (this module's by default) that pytest will run
    (after -k, --lf, ...)."""
    module = module or request.module
    return {item.callspec.params[param] for item in request.session.items
            if item.module is module and param in getattr(getattr(item, "callspec", None), "params", {})}


@dataclass(frozen=True)
class Matrix:
    """A file's parity layouts as its tests train them: layout ``name`` is the run ``prefix + name``,
    ``extra`` overrides first; ``param``: the test parameter (a Layout or its name) that selects
    one. A file that names its matrix ``MATRIX`` lends it to the session: a batch another file
    launches with room left takes this file's selected layouts along (``prefetch_selected``)."""

    layouts: tuple[Layout, ...]
    param: str = "layout"
    prefix: str = ""
    extra: tuple[str, ...] = ()

    def selected(self, request, module=None) -> dict[str, tuple[int, list[str]]]:
        wanted = {str(value) for value in selected_params(request, self.param, module)}
        return {self.prefix + layout.name: (layout.nproc, [*self.extra, *layout.overrides])
                for layout in self.layouts if layout.name in wanted}


def prefetch_selected(request, parity: Parity, matrix: Matrix,
                      also: dict[str, tuple[int, list[str]]] | None = None) -> None:
    """Batch the layouts of this module's tests that will run (and ``also`` these runs), filling
    each batch's spare room with other files' selected layouts of the same rank count (their
    ``MATRIX``), so that fewer launches pay torchrun's and the ranks' start-up."""
    spare = {}
    for module in dict.fromkeys(item.module for item in request.session.items):
        other = getattr(module, "MATRIX", None)
        if module is not request.module and isinstance(other, Matrix):
            spare |= {name: spec for name, spec in other.selected(request, module).items() if name not in spare}
    parity.prefetch({**(also or {}), **matrix.selected(request)}, spare)


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
            run.assert_finished(PARITY_STEPS)
            self.assert_planned_model_state(run, arguments, nproc)
            self.checked.add(key)
        return run

    def train(self, layout: Layout, prefix: str = "", extra: list[str] = ()) -> Run:
        """``layout``'s run (named ``prefix + name``, ``extra`` overrides first), checked as ``run`` does."""
        return self.run(prefix + layout.name, layout.nproc, [*extra, *layout.overrides])

    def prefetch(self, layouts: dict[str, tuple[int, list[str]]],
                 spare: dict[str, tuple[int, list[str]]] | None = None) -> None:
        """Train the layouts no test of the session ran yet, a few per launch (tests/harness/store.py),
        with ``spare`` ones in the room left (``RunStore.get``); ``run`` then reads them."""
        wanted = {name: (n, self.arguments(o)) for name, (n, o) in layouts.items()}
        spare = {name: (n, self.arguments(o)) for name, (n, o) in (spare or {}).items()}
        records = self.store.get({name: spec for name, spec in wanted.items() if run_key(*spec) not in self.runs},
                                 spare)
        self.runs |= {run_key(*wanted[name]): Run.from_record(record) for name, record in records.items()}

    @staticmethod
    def arguments(overrides: list[str]) -> list[str]:
        return [*FAST, f"train.steps={PARITY_STEPS}", *overrides, "train.save_model=true"]

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
        its twins (perturbed gradients, tests/harness/tolerance.py) in one launch."""
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
        reference's own sensitivity implies (tests/harness/tolerance.py)."""
        reference, tolerance = self.measured(*self._reference(tied))
        assert_matches(reference, run, tolerance=tolerance, weights=True)
