"""Held-out evaluation and document masking across layouts: one process, dp2, tp2 (sequence
parallel) and pp2 under 1F1B, Interleaved1F1B and ZBVZeroBubble train to the same losses and
the same val_loss."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from harness.parity import PARITY_STEPS, SAVE_EVERY, Matrix, assert_matches, layouts, prefetch_selected
from harness.runs import RUN_TIMEOUT_S, env, relative_error
from harness.tolerance import ONE_PASS

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.config.schema import DataConfig, EvalConfig
from parallel3d.data import BatchSpec, load_tokenizer, open_eval_corpus, text_files, write_token_file
from parallel3d.inference.evaluate import Evaluator
from parallel3d.validate import check

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def paragraph_token_file(path: Path, package: str, max_bytes: int) -> Path:
    """Short documents (the blank-line separated paragraphs of a stdlib package's sources), so a
    64-token window holds several of them."""
    docs = [p for text in text_files(STDLIB / package, "*.py", max_bytes) for p in text.split("\n\n") if p.strip()]
    return write_token_file(docs, load_tokenizer("byte"), path)


@pytest.fixture(scope="module")
def token_files(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("documents")
    return (paragraph_token_file(root / "train.bin", "json", 200_000),
            paragraph_token_file(root / "heldout.bin", "email", 60_000))


@pytest.mark.fast
def test_eval_is_due_every_n_steps_and_at_the_last(token_files):
    tokens = open_eval_corpus(DataConfig(), EvalConfig(sources=[str(token_files[1])])).tokens
    spec = BatchSpec(16, 4, 64)
    assert [s for s in range(1, 11) if Evaluator(tokens, spec, 0, EvalConfig(every=4), 10).due(s)] == [4, 8, 10]
    assert [s for s in range(1, 11) if Evaluator(tokens, spec, 0, EvalConfig(every=0), 10).due(s)] == [10]
    assert open_eval_corpus(DataConfig(), EvalConfig()) is None


@pytest.mark.parametrize("key, value", [("eval.batches", 0), ("eval.every", -1), ("eval.sources", "[/no/such.bin]")])
def test_eval_keys_are_validated(key, value):
    with pytest.raises(ConfigError, match=rf"^{key}=") as error:
        check(compose([f"{key}={value}"]), 1)
    assert "Fix:" in str(error.value) and "\n" not in str(error.value)


LAYOUTS = layouts({  # name: (ranks, overrides); micro batches as large as the layout allows (fewer collectives)
    "dp2": (2, ["parallel.dp_shard=2", "train.micro_batch_size=8"]),
    "tp2": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=16"]),
    "pp2-1F1B": (2, ["parallel.pp=2", "parallel.pp_schedule=1F1B", "train.micro_batch_size=4"]),
    "pp2-Interleaved1F1B": (2, ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "train.micro_batch_size=4"]),
    "pp2-ZBVZeroBubble": (2, ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "train.micro_batch_size=4"]),
    # Context parallelism: document ids and positions are read off whole sequences, then cut to
    # each cp rank's head-tail share; each method applies the mask across the ranks.
    "cp2-ring": (2, ["parallel.cp=2", "parallel.cp_method=ring", "train.micro_batch_size=16"]),
    "cp2-tp2-pp2-alltoall": (8, ["parallel.cp=2", "parallel.cp_method=alltoall", "parallel.tp=2", "parallel.pp=2",
                                 "train.micro_batch_size=4"]),
})


def document_overrides(token_files) -> list[str]:
    train, heldout = token_files
    return ["data.source=file", f"data.path={train}", "data.document_masking=true", "data.reset_positions=true",
            f"eval.sources=[{heldout}]", f"eval.every={SAVE_EVERY}", "eval.batches=2"]


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request, token_files):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py)."""
    prefetch_selected(request, parity, Matrix(tuple(LAYOUTS), prefix="documents-",
                                             extra=tuple(document_overrides(token_files))))


def reference(token_files) -> tuple[str, list[str]]:
    """The one-process run (it trains with its twins, tests/harness/tolerance.py). checkpoint.every:
    parallel3d-evaluate evaluates its middle checkpoint again (test_evaluate_a_checkpoint_at_dp2)."""
    return "documents-reference", [*document_overrides(token_files), "train.micro_batch_size=16",
                                   f"checkpoint.every={SAVE_EVERY}"]


def plain(token_files) -> list[str]:
    """The reference's data without document masking, position resets or evaluation."""
    return ["data.source=file", f"data.path={token_files[0]}", "train.micro_batch_size=16"]


@pytest.fixture(scope="module")
def documents_reference(parity, token_files):
    # the plain run trains in the reference's launch: one process start-up for both
    parity.prefetch_references(dict([reference(token_files)]), others={"documents-plain": plain(token_files)})
    return parity.measured(*reference(token_files))[0]


def test_reference_evaluates_at_every_and_last_step(documents_reference, token_files):
    rows = documents_reference.metrics
    assert [r["step"] for r in rows if "val_loss" in r] == [SAVE_EVERY, PARITY_STEPS]
    for row in rows:
        if "val_loss" in row:
            assert row["val_perplexity"] == pytest.approx(math.exp(row["val_loss"]), rel=1e-12)
    held_out = [row["val_loss"] for row in rows if "val_loss" in row]
    assert held_out[-1] < held_out[0]  # it learns, and the held-out loss shows it
    console = documents_reference.stdout + documents_reference.stderr
    assert sum(f"val_loss {rows[s - 1]['val_loss']:.4f}" in console for s in (SAVE_EVERY, PARITY_STEPS)) == 2


def test_document_masking_changes_training(documents_reference, token_files, parity):
    """The same data without masking/reset trains differently: the mask is live in these runs."""
    unmasked = parity.run("documents-plain", 1, plain(token_files))
    round_off = parity.measured(*reference(token_files))[1]["loss"]  # what round-off does to the reference
    assert relative_error(documents_reference.losses, unmasked.losses) > round_off  # a change, not noise


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layouts_train_and_evaluate_alike(layout, documents_reference, token_files, parity):
    run = parity.train(layout, prefix="documents-", extra=document_overrides(token_files))
    assert len([r for r in run.metrics if "val_loss" in r]) == 2
    tolerance = parity.measured(*reference(token_files))[1]
    assert_matches(documents_reference, run, tolerance=tolerance, metrics=("loss", "val_loss"), weights=True)


@pytest.mark.multirank
def test_evaluate_a_checkpoint_at_dp2(documents_reference):
    """parallel3d-evaluate on the one-process run's middle checkpoint (step SAVE_EVERY), at dp2: the val_loss training logged
    there, in a metrics line of its own run_dir (the training run's metrics untouched)."""
    run_dir = documents_reference.run_dir
    logged = next(r["val_loss"] for r in documents_reference.metrics if r["step"] == SAVE_EVERY)
    rows_before = (run_dir / "metrics.jsonl").read_text()
    saved = run_dir / "checkpoints" / f"step_{SAVE_EVERY}"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "parallel3d.cli.evaluate", str(saved), "parallel.dp_shard=2",
                           "train.micro_batch_size=8"],
                          capture_output=True, text=True, env=env(), cwd=run_dir.parent, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run_dir / "eval" / f"step_{SAVE_EVERY}" / "metrics.jsonl"
    [line] = [json.loads(row) for row in out.read_text().splitlines()]
    assert line["step"] == SAVE_EVERY and line["layout"]["dp_shard"] == 2
    assert relative_error([line["val_loss"]], [logged]) <= ONE_PASS  # one pass over the held-out data
    assert f"val_loss {line['val_loss']:.6f}" in proc.stdout and str(out) in proc.stdout
    assert (run_dir / "metrics.jsonl").read_text() == rows_before


def test_evaluate_says_when_there_is_nothing_to_evaluate_on(documents_reference, capsys):
    from parallel3d.cli import evaluate

    saved = documents_reference.run_dir / "checkpoints" / f"step_{SAVE_EVERY}"
    assert evaluate.main([str(saved), "eval.sources=[]"]) == 2
    assert "eval.sources=[]: nothing to evaluate on" in capsys.readouterr().err
    assert evaluate.main([str(saved), "no_such_key=1"]) == 2
    assert "not a valid override" in capsys.readouterr().err
