"""The suite's CPU seconds per file, from a per-test log (``P3D_TEST_CPU_LOG=FILE python -m pytest``).

    python tools/suite_cpu.py FILE [FILE ...]               # a table: CPU seconds per file, most first
    python tools/suite_cpu.py --compare BEFORE AFTER        # two logs side by side, per file
    python tools/suite_cpu.py --layouts FILE                # each batched layout's CPU seconds

Each log line is ``{"test": NODE_ID, "cpu_s": SECONDS}`` (tests/conftest.py writes them): the CPU of
the test's own process and of every process it waited for (its torchrun jobs), a module fixture's
runs counted at the test that first used them. tests/cpu_log.jsonl is the committed log the suite
orders its files by (longest first: tests/conftest.py).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def per_file(paths: list[Path]) -> Counter:
    """CPU seconds per test file over the logs (a test logged twice counts its last entry)."""
    tests: dict[str, float] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "test" in row:  # (lines with "layout" are the layouts of batched launches)
                tests[row["test"]] = row["cpu_s"]
    files: Counter = Counter()
    for node_id, seconds in tests.items():
        files[node_id.split("::")[0]] += seconds
    return files


def per_layout(paths: list[Path]) -> list[tuple[float, str, int]]:
    """(CPU seconds, name, ranks) of each layout trained in a batch (tests/conftest.py), the most first."""
    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines() if '"layout"' in line]
    return sorted(((row["cpu_s"], row["layout"], row["nproc"]) for row in rows), reverse=True)


def table(files: Counter) -> str:
    rows = ["| file | CPU s |", "|---|---:|"]
    rows += [f"| `{name}` | {seconds:.0f} |" for name, seconds in files.most_common()]
    rows.append(f"| **all** | **{sum(files.values()):.0f}** |")
    return "\n".join(rows)


def compare(before: Counter, after: Counter) -> str:
    rows = ["| file | before, CPU s | after, CPU s |", "|---|---:|---:|"]
    for name in sorted(before.keys() | after.keys(), key=lambda n: -max(before[n], after[n])):
        rows.append(f"| `{name}` | {before[name]:.0f} | {after[name]:.0f} |")
    rows.append(f"| **all** | **{sum(before.values()):.0f}** | **{sum(after.values()):.0f}** |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--compare", action="store_true", help="two logs: BEFORE AFTER")
    parser.add_argument("--layouts", action="store_true", help="the batched layouts' CPU seconds instead")
    args = parser.parse_args(argv)
    if args.layouts:
        print("\n".join(f"{cpu:8.1f}  {name} ({nproc} ranks)" for cpu, name, nproc in per_layout(args.logs)))
    elif args.compare:
        before, after = args.logs
        print(compare(per_file([before]), per_file([after])))
    else:
        print(table(per_file(args.logs)))


if __name__ == "__main__":
    main()
