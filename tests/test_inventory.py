"""tests/CLAIMS.md names every test the suite collects, and only those (tests/harness/inventory.py)."""

from __future__ import annotations

import pytest
from conftest import DESELECTED
from harness.inventory import CLAIMS, TESTS, as_row_cell, collected_tests, named_tests, report


def suite_ids(session) -> list[str]:
    """The suite's node ids: this session's, when it collected every test file (``-m``, ``-k``
    deselect without skipping a file), else from a ``pytest --collect-only`` of its own."""
    ids = [item.nodeid for item in session.items] + DESELECTED
    files = {node_id.split("::")[0] for node_id in ids}
    if files >= {f"tests/{path.name}" for path in TESTS.glob("test_*.py")}:
        return ids
    return collected_tests()


@pytest.mark.fast
def test_claims_name_every_collected_test_and_only_those(request):
    problems = report(suite_ids(request.session), CLAIMS.read_text())
    assert not problems, f"tests/CLAIMS.md is out of date with the suite:\n{problems}"


ODD_IDS = ["tests/test_a.py::test_f[ep2 dp2 ZeRO-1, every 2nd block]", "tests/test_a.py::test_f[<|end_of_text|>]",
           "tests/test_a.py::test_f[eval.sources-[/no/such.bin]]", "tests/test_a.py::test_f[--gpus 8 ]",
           "tests/test_b.py::test_g"]


@pytest.mark.fast
def test_what_the_checker_prints_is_what_the_file_reads():
    """Ids with commas, brackets, pipes and a trailing space: the cell the checker prints for them,
    pasted into a row, reads back as the same node ids; a missing and a stale name are reported."""
    row = f"| a claim | losses | derived | {'<br>'.join(as_row_cell(ODD_IDS))} |"
    table = f"| claim | compared | tolerance | tests |\n|---|---|---|---|\n{row}\n"
    assert named_tests(table) == ODD_IDS
    assert report(ODD_IDS, table) == ""
    missing_and_stale = report([*ODD_IDS[1:], "tests/test_c.py::test_h[tp2]"], table)
    assert "`test_c.py::test_h` `tp2`" in missing_and_stale and "tests/test_a.py::test_f[ep2 dp2 ZeRO-1, every 2nd block]" \
        in missing_and_stale.split("does not collect")[1]
