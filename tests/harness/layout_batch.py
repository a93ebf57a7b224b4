"""Train several layouts in one launch, each as `python -m parallel3d.train` would.

    torchrun --standalone --nproc-per-node N tests/harness/layout_batch.py SPEC.json   (or python, for N=1)

A launch of the test suite's parity matrix spends most of its time starting up: importing torch,
DTensor and Hydra costs ~6 s of CPU per rank (README.md, Tests), so 4 ranks on 2 cores wait longer
for the first step of a 10-step run than the run then trains. A batch pays that once for several layouts.

SPEC.json is a list of {"run_dir": PATH, "overrides": [...]}. Each layout gets a process group of its
own, under a store prefix of its own (the previous group's keys are never read: pytorch#135712),
and runs through the same ``train()``; torch.compile's caches are reset between layouts. Each rank
writes what it printed and its exit code to RUN_DIR.batch/rank<N>.json. The first layout that fails
on any rank ends the batch (after a failed collective the ranks may disagree about where they are):
the caller runs the rest, and the failed one, in launches of their own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.base import ConfigError, world_size_from_env
from parallel3d.config.compose import compose
from parallel3d.runtime.rundir import release_run_dir
from parallel3d.train import TrainingDiverged, train

TIMEOUT = timedelta(seconds=300)


def base_store(rank: int, world_size: int) -> dist.Store | None:
    """torchrun's agent store when it shares it (torch >= 2.5), else one rank 0 serves."""
    if world_size == 1:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=rank == 0 and not agent, timeout=TIMEOUT)


def train_one(run_dir: str, overrides: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one layout, with run_job's exit codes."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train(compose([f"run_dir={run_dir}", *overrides]))
            if dist.is_initialized():
                dist.barrier()  # as run_job: no rank tears its group down while another still uses it
        except ConfigError as e:
            code = 2
            print(f"parallel3d: config error: {e}", file=sys.stderr)
        except TrainingDiverged as e:
            code = 3
            print(f"parallel3d: training stopped: {e}", file=sys.stderr)
        except Exception:
            code = 1
            traceback.print_exc()
        finally:
            release_run_dir(run_dir)
    return code, out.getvalue(), err.getvalue()


def all_succeeded(store: dist.Store | None, index: int, rank: int, world_size: int, code: int) -> bool:
    """Every rank's verdict on layout ``index``, through the store (the group is gone by then)."""
    if store is None:
        return code == 0
    store.set(f"layout_batch/{index}/code{rank}", str(code))
    return all(store.get(f"layout_batch/{index}/code{r}") == b"0" for r in range(world_size))


def main(spec_path: str) -> int:
    layouts = json.loads(Path(spec_path).read_text())
    rank, world_size = int(os.environ.get("RANK", "0")), world_size_from_env()
    store = base_store(rank, world_size)
    for index, layout in enumerate(layouts):
        if store is not None:
            dist.init_process_group("gloo", store=dist.PrefixStore(f"layout_batch/{index}/pg/", store),
                                    rank=rank, world_size=world_size, timeout=TIMEOUT)
        cpu = time.process_time()
        try:
            code, out, err = train_one(layout["run_dir"], layout["overrides"])
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            torch._dynamo.reset()  # each layout compiles its own model, as in a launch of its own
        result = Path(f"{layout['run_dir']}.batch") / f"rank{rank}.json"
        result.parent.mkdir(parents=True, exist_ok=True)
        # cpu_s: this rank's CPU seconds for the layout (what it costs the suite beside the launch's start-up)
        result.write_text(json.dumps({"returncode": code, "stdout": out, "stderr": err,
                                      "cpu_s": round(time.process_time() - cpu, 2)}))
        if not all_succeeded(store, index, rank, world_size, code):
            return 1
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # gloo may abort in C++ static destructors after a clean run (see parallel3d.train.main)
