"""CPU seconds of importing the trainer against importing torch alone, each in fresh processes.

    python tools/bench_import.py [--repeats 5]

Every rank of every job pays the import before it trains (the suite's launches too). Prints a
Markdown table for BENCHMARKS.md: the median user + system CPU seconds of ``python -c "import X"``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

MODULES = ("torch", "parallel3d.train", "parallel3d.launch.run")


def cpu_seconds(module: str) -> float:
    """User + system CPU of one fresh interpreter importing ``module``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    medians = {}
    for _ in range(args.repeats):  # interleaved: a busy spell hits every module alike
        for module in MODULES:
            medians.setdefault(module, []).append(cpu_seconds(module))
    base = statistics.median(medians["torch"])
    print("| import | CPU s (median) | beyond torch |\n|---|---:|---:|")
    for module, values in medians.items():
        median = statistics.median(values)
        print(f"| `{module}` | {median:.2f} | {median - base:+.2f} |")


if __name__ == "__main__":
    main()
