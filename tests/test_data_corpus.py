"""Training on a mixture of jsonl + parquet + a saved dataset, end to end through train.py.

With document masking and held-out evaluation (eval.fraction of the documents, every 5 steps),
one process, dp2 and pp2 x tp2 train to the same losses and val_loss (within what the one-process
run's own sensitivity implies: tests/harness/tolerance.py); the ranks of
each job split the tokenization; a run resumed from the dp2 run's step 5 in one process (another layout
and dp degree) continues with the same tokens and losses. Launched with conftest's launch()
rather than Parity.run: these runs compare with each other, not with the stdlib reference.
"""

from __future__ import annotations

import pytest
from harness.data_files import write_mixture
from harness.parity import assert_matches
from harness.runs import FAST, STEPS, Run, launch, launch_measured
from harness.tolerance import Tolerance

from parallel3d.data import TokenFile

SOURCES = ["web", "books", "wiki"]


class MixtureRuns:
    def __init__(self, root):
        self.root, self.runs = root, {}
        self.sources = write_mixture(root / "src", scale=4)

    def arguments(self, name: str, overrides: list[str]) -> list[str]:
        return [*FAST, f"data.sources=[{','.join(self.sources)}]", "data.weights=[2,1,1]", "eval.fraction=0.1",
                "eval.every=5", "data.document_masking=true", f"data.cache_dir={self.root / ('cache-' + name)}",
                *overrides]

    def single(self) -> tuple[Run, Tolerance]:
        """The one-process run and the tolerance its twins imply (trained after it, from its cache)."""
        if "single" not in self.runs:
            self.runs["single"], self.tolerance = launch_measured(
                self.root, self.arguments("single", ["train.micro_batch_size=16"]), 10, name="single",
                metrics=("loss", "val_loss"), weights=False)
        return self.runs["single"], self.tolerance

    def run(self, name: str, nproc: int, overrides: list[str], steps_from: int = 1):
        if name not in self.runs:
            run = launch(self.root / name, self.arguments(name, overrides), nproc=nproc)
            run.assert_finished(STEPS)
            assert [r["step"] for r in run.metrics] == list(range(steps_from, STEPS + 1)), run.stderr[-2000:]
            self.runs[name] = run
        return self.runs[name]

    def tokenized_by(self, name: str) -> set[str]:
        metas = (TokenFile(p).meta for p in (self.root / f"cache-{name}").glob("*.bin") if "heldout" not in p.name)
        return {m["tokenized_by"] for m in metas}


@pytest.fixture(scope="module")
def mixture(runs_root) -> MixtureRuns:
    return MixtureRuns(runs_root / "mixture")


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
    run = mixture.run("dp2", 2, ["checkpoint.every=5"])
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
    saved = mixture.run("dp2", 2, ["checkpoint.every=5"])
    step5 = saved.run_dir / "checkpoints" / "step_5"
    run = mixture.run("resumed-single", 1, [f"checkpoint.resume={step5}", "train.micro_batch_size=8"], steps_from=6)
    assert_matches(saved, run, tolerance=mixture.single()[1], metrics=("loss",))  # steps 6-10
    for row, before in zip(run.metrics, saved.metrics[5:]):
        assert [row[f"tokens/{s}"] for s in SOURCES] == [before[f"tokens/{s}"] for s in SOURCES]
