"""tests/harness/layout_batch.py: the first layout that fails ends the batch, and the harness gets back
only the layouts that finished on every rank (the rest run in launches of their own);
tests/harness/store.py: a batch's spare room takes other files' layouts along."""

from __future__ import annotations

import fcntl

import pytest
from harness.runs import FAST, launch_batch
from harness.store import RunStore, run_key


@pytest.mark.fast
def test_a_failed_layout_ends_the_batch_and_is_not_returned(tmp_path):
    layouts = {"refused": [*FAST, "train.steps=2", "parallel.tp=3"],  # 3 ranks needed, 1 given
               "after": [*FAST, "train.steps=2"]}
    assert launch_batch(tmp_path, layouts, nproc=1) == {}
    result = (tmp_path / "refused.batch" / "rank0.json").read_text()
    assert '"returncode": 2' in result and "config error" in result
    assert not (tmp_path / "after.batch").exists()  # never started: the batch ended at the failure


@pytest.mark.fast
def test_a_batch_with_room_takes_spare_runs_along_and_never_waits_for_them(tmp_path):
    """RunStore.get fills the room its last batch of a rank count leaves with spare runs of that rank
    count (other files' parity layouts), skips one another worker holds, and returns only what was
    asked; a later get of a spare run reads it without a launch."""
    launched = []

    def batch(root, layouts, nproc):
        launched.append((nproc, sorted(name.rsplit("-", 1)[0] for name in layouts)))
        return {name: {"run_dir": str(root / name), "returncode": 0, "stdout": "", "stderr": ""} for name in layouts}

    store = RunStore(tmp_path, batch, lambda *args: pytest.fail("a launch of its own"), batch_size=4)
    spare = {"held": (2, ["x=0"]), "s1": (2, ["x=1"]), "s2": (2, ["x=2"]), "s3": (2, ["x=3"]), "four": (4, ["x=4"])}
    with open(tmp_path / f"{run_key(2, ['x=0'])}.lock", "w") as other_worker:
        fcntl.flock(other_worker, fcntl.LOCK_EX)
        got = store.get({"w1": (2, ["y=1"]), "w2": (2, ["y=2"])}, spare)
    assert set(got) == {"w1", "w2"}
    assert launched == [(2, ["s1", "s2", "w1", "w2"])]  # room 2; "held" skipped; no rank count of its own
    assert store.get({"later": (2, ["x=2"])})["later"]["returncode"] == 0 and len(launched) == 1
    assert store.record(run_key(2, ["x=3"])) is None
