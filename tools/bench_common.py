"""What the benchmark tools share: a fixed number of torch threads while they measure, and the
heading of the Markdown block they print for BENCHMARKS.md (what, when, on what, by which command)."""

from __future__ import annotations

import logging
import platform
import sys
from collections.abc import Callable
from contextlib import contextmanager
from datetime import date

import torch


@contextmanager
def torch_threads(n: int):
    """Intra-op threads for the measurement, restored afterwards (tests call the tools in-process).
    One thread keeps CPU time stable on a shared machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def heading(title: str, tool: str, argv: list[str] | None, machine: str = "") -> str:
    """``### title (date)``, then the machine and the command line (``tool`` and its arguments)."""
    command = " ".join(sys.argv[1:] if argv is None else argv)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or "CPU")
    return (f"### {title} ({date.today().isoformat()})\n\n"
            f"Machine: {platform.node()}, {device}{', ' + machine if machine else ''}, torch {torch.__version__}, "
            f"Python {platform.python_version()}  \n"
            f"Command: `python tools/{tool} {command}`  ")


def print_dry_run_table(title: str, tool: str, argv: list[str] | None, rows: Callable[[], list[str]]) -> int:
    """The Markdown block of a tool that measures with the dry run: heading, then ``rows()``."""
    # DTensor warns for every redistribution the fake process group cannot order: noise here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    print(heading(title, tool, argv, "dry run: fake process group, fake tensors") + "\n")
    print("\n".join(rows()))
    return 0
