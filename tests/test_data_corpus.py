"""Training on a mixture of jsonl + parquet + a saved dataset, end to end through train.py.

With document masking and held-out evaluation (eval.fraction of the documents, every 5 steps),
one process, dp2 and pp2 x tp2 train to the same losses and val_loss (within what the one-process
run's own sensitivity implies: tests/harness/tolerance.py); the ranks of
each job split the tokenization; a run resumed from the dp2 run's step 5 in one process (another layout
and dp degree) continues with the same tokens and losses. Launched with conftest's launch() and
launch_batch() rather than Parity.run: these runs compare with each other, not with the stdlib
reference. The one-process runs (the reference, its twin, the resumed run) train in one launch,
after the dp2 run the resumed one starts from: one process start-up for the three.
"""

from __future__ import annotations

import pytest
from harness.data_files import write_mixture
from harness.parity import assert_matches
from harness.runs import FAST, STEPS, Run, launch, launch_batch
from harness.tolerance import Tolerance, measure, twins

from parallel3d.data import TokenFile

SOURCES = ["web", "books", "wiki"]


DP2 = ["checkpoint.every=5"]
RESUMED = "test_resumed_at_another_layout_and_dp_degree_continues_the_same_tokens"


class MixtureRuns:
    def __init__(self, root, resumes: bool):
        self.root, self.runs, self.resumes = root, {}, resumes  # resumes: the resumed run's test will run
        self.sources = write_mixture(root / "src", scale=4)

    def arguments(self, name: str, overrides: list[str]) -> list[str]:
        return [*FAST, f"data.sources=[{','.join(self.sources)}]", "data.weights=[2,1,1]", "eval.fraction=0.1",
                "eval.every=5", "data.document_masking=true", f"data.cache_dir={self.root / ('cache-' + name)}",
                *overrides]

    def single(self) -> tuple[Run, Tolerance]:
        """The one-process run and the tolerance its twins imply (trained after it, from its cache)."""
        if "single" not in self.runs:
            self.train_one_process()
        return self.runs["single"], self.tolerance

    def train_one_process(self) -> None:
        """The one-process runs in one launch (each failed one again on its own, with its errors):
        the reference, its twins and, when its test will run, the run resumed from dp2's step 5."""
        reference = self.arguments("single", ["train.micro_batch_size=16"])
        wanted = {"single": reference, **twins("single", reference)}
        if self.resumes:
            step5 = self.run("dp2", 2, DP2).run_dir / "checkpoints" / "step_5"
            wanted["resumed-single"] = self.arguments("resumed-single", [f"checkpoint.resume={step5}",
                                                                         "train.micro_batch_size=8"])
        done = launch_batch(self.root, wanted, nproc=1)
        for name, overrides in wanted.items():
            run = done.get(name) or launch(self.root / name, overrides)
            self.runs[name] = self.checked(run, steps_from=6 if name == "resumed-single" else 1)
        perturbed = [self.runs[name] for name in twins("single", reference)]
        self.tolerance = measure(self.runs["single"], *perturbed, metrics=("loss", "val_loss"), weights=False)

    def run(self, name: str, nproc: int, overrides: list[str], steps_from: int = 1):
        if name not in self.runs:
            self.runs[name] = self.checked(launch(self.root / name, self.arguments(name, overrides), nproc=nproc),
                                           steps_from)
        return self.runs[name]

    @staticmethod
    def checked(run: Run, steps_from: int) -> Run:
        run.assert_finished(STEPS)
        assert [r["step"] for r in run.metrics] == list(range(steps_from, STEPS + 1)), run.stderr[-2000:]
        return run

    def tokenized_by(self, name: str) -> set[str]:
        metas = (TokenFile(p).meta for p in (self.root / f"cache-{name}").glob("*.bin") if "heldout" not in p.name)
        return {m["tokenized_by"] for m in metas}


@pytest.fixture(scope="module")
def mixture(runs_root, request) -> MixtureRuns:
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    return MixtureRuns(runs_root / "mixture", resumes=RESUMED in selected)


def single(mixture):
    return mixture.single()[0]


def test_one_process_reports_tokens_per_source_and_data_wait(mixture):
    run = single(mixture)
    for row in run.metrics:
        consumed = [row[f"tokens/{s}"] for s in SOURCES]
        assert sum(consumed) == row["step"] * 16 * 64  # cumulative input tokens, every sample counted once
        assert row["data_wait_s"] >= 0  # how long it is: BENCHMARKS (f), not a bound a loaded machine may cross
    last = run.metrics[-1]
    assert last["tokens/web"] > max(last["tokens/books"], last["tokens/wiki"])  # weight 2 against 1 and 1
    assert mixture.tokenized_by("single") == {"rank 0"}
    assert [r["step"] for r in run.metrics if "val_loss" in r] == [5, STEPS]


@pytest.mark.multirank
def test_dp2_trains_the_same_and_its_ranks_split_tokenization(mixture):
    run = mixture.run("dp2", 2, DP2)
    reference, tolerance = mixture.single()
    assert_matches(reference, run, tolerance=tolerance, metrics=("loss", "val_loss"))
    assert [r["tokens/wiki"] for r in run.metrics] == [r["tokens/wiki"] for r in reference.metrics]
    assert mixture.tokenized_by("dp2") == {"rank 0", "rank 1"}


@pytest.mark.multirank
def test_pp2_tp2_trains_the_same(mixture):
    run = mixture.run("pp2-tp2", 4, ["parallel.pp=2", "parallel.tp=2", "train.micro_batch_size=4"])
    reference, tolerance = mixture.single()
    assert_matches(reference, run, tolerance=tolerance, metrics=("loss", "val_loss"))
    assert mixture.tokenized_by("pp2-tp2") == {"rank 0", "rank 1", "rank 2", "rank 3"}  # five shards, four ranks


@pytest.mark.multirank
def test_resumed_at_another_layout_and_dp_degree_continues_the_same_tokens(mixture):
    saved = mixture.run("dp2", 2, DP2)
    mixture.single()  # the resumed run trains with the one-process runs, from saved's step 5
    run = mixture.runs["resumed-single"]
    assert_matches(saved, run, tolerance=mixture.single()[1], metrics=("loss",))  # steps 6-10
    for row, before in zip(run.metrics, saved.metrics[5:]):
        assert [row[f"tokens/{s}"] for s in SOURCES] == [before[f"tokens/{s}"] for s in SOURCES]
