"""tests/harness/layout_batch.py: the first layout that fails ends the batch, and the harness gets back
only the layouts that finished on every rank (the rest run in launches of their own)."""

from __future__ import annotations

import pytest
from harness.runs import FAST, launch_batch


@pytest.mark.fast
def test_a_failed_layout_ends_the_batch_and_is_not_returned(tmp_path):
    layouts = {"refused": [*FAST, "train.steps=2", "parallel.tp=3"],  # 3 ranks needed, 1 given
               "after": [*FAST, "train.steps=2"]}
    assert launch_batch(tmp_path, layouts, nproc=1) == {}
    result = (tmp_path / "refused.batch" / "rank0.json").read_text()
    assert '"returncode": 2' in result and "config error" in result
    assert not (tmp_path / "after.batch").exists()  # never started: the batch ended at the failure
