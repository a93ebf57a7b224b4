#!/usr/bin/env python
"""How far float32 round-off carries in each family of parity runs, and the tolerances it implies
(tests/harness/tolerance.py). Prints Markdown blocks for BENCHMARKS.md.

    python tools/parity_sensitivity.py measure [--families default,muon] [--draws 3] [--capabilities avx2,default]

``measure`` trains each family's one-process reference (the overrides the test files use) and its
twin (``debug.grad_noise``: gradients perturbed by the round-off of a float32 matmul on this machine,
relative to each tensor's root mean square; tests/harness/tolerance.py) with ``--draws`` noise
draws, all in one process, then the reference again under each of ``--capabilities``
(torch's ``ATEN_CPU_CAPABILITY``: the same run with another CPU kernel set, one process each). Per
metric it prints the spread of every draw and of every kernel set against the reference, and the
tolerance the suite derives (from the first ``DRAWS`` draws): the noise stands in for another order
of the same sums when its spread is of the kernel sets' size.

    python tools/parity_sensitivity.py summarize PARITY_LOG.jsonl [...]

``summarize`` reads what ``P3D_PARITY_LOG=FILE python -m pytest ...`` wrote (one line per parity
comparison: the errors of a layout, their tolerances, the reference's spreads) and prints, per
family and kernel set, the largest error against the spread (how far layouts go beyond one noise
draw) and the smallest headroom (tolerance over error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))  # the suite's harness and the families' overrides

from bench_common import heading  # noqa: E402 (after the path insert)

KEYS = ("loss", "grad_norm", "aux_loss", "weights")


def families() -> dict[str, list[str]]:
    """name: the one-process reference's overrides, as the test files train it."""
    import test_lora
    import test_muon
    import test_parallel_expert
    import test_parallel_mla
    import test_precision

    return {
        "default": ["model.tie_embeddings=False", "train.micro_batch_size=16"],
        "default-tied": ["model.tie_embeddings=True", "train.micro_batch_size=16"],
        "moe": [*test_parallel_expert.MOE, "train.micro_batch_size=16"],
        "mla": [*test_parallel_mla.MLA, "train.micro_batch_size=16"],
        "mla-lr3e-3": [*test_parallel_mla.MLA, "optim.lr=3e-3", "train.micro_batch_size=16"],
        "lora": [*test_lora.LORA, "train.micro_batch_size=16"],
        "muon": test_muon.REFERENCES[False][1],
        "muon-lr3e-3": [*test_muon.MUON, "train.micro_batch_size=16"],
        "bf16": test_precision.reference_overrides(16),
        "bf16-lr3e-3": ["train.param_dtype=bfloat16", "train.micro_batch_size=16"],
    }


def train(root: Path, runs: dict[str, list[str]], capability: str | None = None) -> dict:
    """Train ``runs`` (name: overrides, with the suite's FAST settings) in one process, under
    ``capability`` (None: torch's choice); returns the runs that finished."""
    from harness.runs import launch_batch
    from harness.parity import Parity

    root.mkdir(parents=True, exist_ok=True)
    previous = os.environ.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        os.environ["ATEN_CPU_CAPABILITY"] = capability
    try:
        return launch_batch(root, {name: Parity.arguments(o) for name, o in runs.items()}, nproc=1)
    finally:
        os.environ.pop("ATEN_CPU_CAPABILITY", None)
        if previous is not None:
            os.environ["ATEN_CPU_CAPABILITY"] = previous


def measure_family(root: Path, name: str, overrides: list[str], draws: int, capabilities: list[str]) -> list[str]:
    """The Markdown rows of one family: per metric, the spread of each draw and kernel set."""
    from harness.tolerance import DRAWS, measure, twin_overrides

    runs = {name: overrides}
    runs |= {f"{name}-draw{d}": twin_overrides(overrides, d) for d in range(draws)}
    done = train(root / "auto", runs)
    others = {cap: train(root / cap, {name: overrides}, cap).get(name) for cap in capabilities}
    missing = [run for run in runs if run not in done] + [cap for cap, run in others.items() if run is None]
    if missing:
        return [f"| {name} | failed: {', '.join(missing)} | | | |"]
    reference = done[name]
    spreads = [measure(reference, done[f"{name}-draw{d}"]) for d in range(draws)]
    suite = measure(reference, *(done[f"{name}-draw{d}"] for d in range(min(draws, DRAWS))))  # what the tests use
    kernels = {cap: measure(reference, run) for cap, run in others.items()}
    rows = []
    for key in (k for k in KEYS if k in spreads[0].spreads):
        draw_cells = ", ".join(f"{s.spreads[key]:.2g}" for s in spreads)
        kernel_cells = ", ".join(f"{cap} {t.spreads[key]:.2g}" for cap, t in kernels.items())
        rows.append(f"| {name} | {key} | {draw_cells} | {kernel_cells} | {suite[key]:.2g} |")
    return rows


def cmd_measure(args) -> int:
    import torch

    chosen = families()
    names = args.families.split(",") if args.families else list(chosen)
    capabilities = [c for c in args.capabilities.split(",") if c]
    from harness.tolerance import grad_noise

    print(heading("Parity sensitivity: one process against its twins and other kernel sets", "parity_sensitivity.py",
                  None, f"torch picks {torch.backends.cpu.get_cpu_capability()}") + "\n")
    print(f"Twin's noise (debug.grad_noise): {grad_noise():g} of each gradient tensor's root mean square.\n")
    print("| family | metric | twin spread, per draw | same run, other kernel set | the suite's tolerance |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="parity_sensitivity_") as tmp:
        for name in names:
            for row in measure_family(Path(tmp), name, chosen[name], args.draws, capabilities):
                print(row, flush=True)
    return 0


def cmd_summarize(args) -> int:
    """Per (family, kernel set, metric): comparisons, largest error / spread, smallest tolerance / error."""
    table = defaultdict(lambda: [0, 0.0, float("inf"), ""])
    for path in args.logs:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            if not row.get("spreads"):
                continue  # a plain bound (float8 against bf16), not a derived one
            family = row["reference"]
            for key, error in row["errors"].items():
                cell = table[(family, row["capability"], key)]
                cell[0] += 1
                beyond = error / row["spreads"][key] if row["spreads"][key] else 0.0
                if beyond > cell[1]:
                    cell[1], cell[3] = beyond, row["run"]
                cell[2] = min(cell[2], row["tolerances"][key] / error if error else float("inf"))
    print(heading("Parity margins: layouts against their derived tolerances", "parity_sensitivity.py", None) + "\n")
    print("| reference | kernels | metric | comparisons | largest error / spread (layout) "
          "| smallest tolerance / error |")
    print("|---|---|---|---|---|---|")
    for (family, capability, key), (count, beyond, headroom, run) in sorted(table.items()):
        print(f"| {family} | {capability} | {key} | {count} | {beyond:.2g} ({run}) | {headroom:.3g} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="one process against its noise twins and other kernel sets")
    m.add_argument("--families", default="", help="comma-separated (default: all)")
    m.add_argument("--draws", type=int, default=3, help="noise draws per family")
    m.add_argument("--capabilities", default="avx2,default", help="ATEN_CPU_CAPABILITY values to compare")
    s = sub.add_parser("summarize", help="tabulate P3D_PARITY_LOG files")
    s.add_argument("logs", nargs="+")
    args = parser.parse_args(argv)
    return cmd_measure(args) if args.command == "measure" else cmd_summarize(args)


if __name__ == "__main__":
    sys.exit(main())
