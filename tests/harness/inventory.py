"""tests/CLAIMS.md against the suite: which collected tests it does not name, which it names that
do not exist (tests/test_inventory.py fails on either).

    python tests/harness/inventory.py        # prints what CLAIMS.md lacks, in its format, and what it names in vain

A row's last cell names its tests: `test_x.py::test_f` for an unparametrized test, or followed by
its parametrize ids, each in backquotes (`test_x.py::test_f` `tp2` `dp2-zero3`); a ``|`` inside an
id is written ``\\|``. Every collected node id (parametrized ids included) must be named exactly
once. This script never writes CLAIMS.md: what a test proves is for its author to say.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent  # tests/
CLAIMS = TESTS / "CLAIMS.md"
CELL = re.compile(r"(?<!\\)\|")  # a table cell boundary: a | not escaped
SPAN = re.compile(r"`([^`]*)`")


def named_tests(text: str) -> list[str]:
    """The node ids (``tests/test_x.py::test_f[id]``) the table rows of ``text`` name, in order."""
    named = []
    for line in text.splitlines():
        cells = CELL.split(line.strip())
        if len(cells) < 3 or not line.lstrip().startswith("|") or set(cells[-2].strip()) <= set("-: "):
            continue
        function, ids = None, []
        for span in [s.replace("\\|", "|") for s in SPAN.findall(cells[-2])] + ["::"]:
            if "::" in span:  # a test function starts: the one before ends
                if function:
                    named += [f"{function}[{i}]" for i in ids] if ids else [function]
                function, ids = (f"tests/{span.removeprefix('tests/')}" if span != "::" else None), []
            elif function:
                ids.append(span)
    return named


def collected_tests(root: Path = TESTS.parent) -> list[str]:
    """The suite's node ids, as ``pytest --collect-only`` lists them (a subprocess: ~8 CPU s)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "-o", "addopts=", "tests"], capture_output=True, text=True, cwd=root)
    listed = done.stdout.split("\n\n", 1)[0]  # the ids, then a blank line and the summary
    ids = [line for line in listed.splitlines() if "::" in line]
    assert done.returncode == 0 and ids, f"collecting the suite failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return ids


def as_row_cell(node_ids: list[str]) -> list[str]:
    """Node ids grouped by test function, as a row's tests cell writes them (one line per function)."""
    functions: dict[str, list[str]] = {}
    for node_id in node_ids:
        function, _, param = node_id.removeprefix("tests/").partition("[")
        functions.setdefault(function, [])
        if param:
            functions[function].append(param[:-1].replace("|", "\\|"))
    return [" ".join([f"`{function}`", *(f"`{i}`" for i in ids)]) for function, ids in functions.items()]


def differences(collected: list[str], text: str) -> tuple[list[str], list[str], list[str]]:
    """(collected but not named, named but not collected, named more than once)."""
    named = named_tests(text)
    twice = sorted(node_id for node_id, count in Counter(named).items() if count > 1)
    named_set, collected_set = set(named), set(collected)
    return ([n for n in collected if n not in named_set], [n for n in named if n not in collected_set], twice)


def report(collected: list[str], text: str) -> str:
    """What CLAIMS.md must change, in words and in its own format; empty when it names the suite."""
    missing, absent, twice = differences(collected, text)
    parts = []
    if missing:
        parts.append(f"{len(missing)} collected tests no row of tests/CLAIMS.md names; add them to the row of "
                     "the claim they prove (or a new row saying what they prove, compared how, at which "
                     "tolerance):\n" + "\n".join(as_row_cell(missing)))
    if absent:
        parts.append(f"{len(absent)} tests tests/CLAIMS.md names that the suite does not collect; a claim "
                     "dropped is a decision: remove them from their row, or move the claim to the tests that "
                     "prove it now:\n" + "\n".join(absent))
    if twice:
        parts.append("named in more than one row (one row per test):\n" + "\n".join(twice))
    return "\n\n".join(parts)


def main() -> int:
    text = report(collected_tests(), CLAIMS.read_text())
    print(text or "tests/CLAIMS.md names every collected test, and only those")
    return 1 if text else 0


if __name__ == "__main__":
    sys.exit(main())
