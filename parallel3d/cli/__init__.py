"""The command-line tools that ship with the wheel as console scripts (pyproject.toml):

    parallel3d-prepare-data  prepare_data.py  tokenize data sources ahead of training
    parallel3d-convert-hf    convert_hf.py    a checkpoint -> a Hugging Face folder
    parallel3d-plan          plan_layout.py   per-rank memory, communication and step time of layouts
    parallel3d-dry-run       dry_run.py       one step of chosen ranks on fake tensors
    parallel3d-plot          plot_metrics.py  metrics.jsonl of runs -> PNGs (needs matplotlib)

Each is also ``python -m parallel3d.cli.<module>``. They sit on top of the library: nothing in
parallel3d imports them.
"""

from __future__ import annotations

import importlib.util
import sys


def plot() -> int:
    """parallel3d-plot: matplotlib is an optional dependency, so say how to get it instead of a traceback."""
    if importlib.util.find_spec("matplotlib") is None:
        print("parallel3d-plot needs matplotlib: pip install matplotlib (or pip install 'parallel3d[tools]')",
              file=sys.stderr)
        return 1
    from parallel3d.cli.plot_metrics import main

    return main()
