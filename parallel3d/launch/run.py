"""parallel3d-run: compose and validate the config once, then hand over to torchrun.

    parallel3d-run [torchrun options] [recipe=NAME] [key=value ...]
    parallel3d-run [torchrun options] --multirun [key=a,b ...]     # one torchrun per combination
    parallel3d-run --recipes-dir DIR [torchrun options] recipe=NAME  # a recipe file kept in DIR

Under plain torchrun every rank would print the same config error and torchrun would add a
traceback of its own. This checks the config in one process first, for the world size that the
torchrun options describe, and prints a single message when it cannot run. Otherwise it replaces
itself with ``torchrun [options] -m parallel3d.train [overrides]``: every option torchrun knows
(``--nnodes``, ``--node-rank``, ``--rdzv-backend``, ``--rdzv-endpoint``, ``--max-restarts`` ...)
passes through unchanged.

Without a ``run_dir=`` override it also fixes Hydra's timestamped output dir (``outputs/DATE/TIME``)
once, here: workers that ``--max-restarts`` starts after a failure compose the config again, later,
and would otherwise write to a new folder instead of resuming from the checkpoints in the old one.
With ``--max-restarts`` it sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see ``restart_env``).

With ``--multirun`` (or ``-m``) it runs a Hydra sweep: every combination is validated first, then
each runs as its own torchrun job, one after another, in ``hydra.sweep.dir/<n>`` (see sweep.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

from parallel3d.launch import sweep
from parallel3d.runtime.rundir import given_run_dir, hydra_run_dir, run_dir_override

EXIT_CONFIG_ERROR = 2


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Hydra overrides (key=value, +key=value, ~key) apart from torchrun's options and values."""
    overrides, torchrun = [], []
    for arg in argv:
        is_override = not arg.startswith("-") and ("=" in arg or arg.startswith("~"))
        (overrides if is_override else torchrun).append(arg)
    return overrides, torchrun


def world_sizes(torchrun_args: list[str]) -> list[int]:
    """The world sizes these torchrun options can give (two for an elastic --nnodes MIN:MAX)."""
    from torch.distributed.run import determine_local_world_size, get_args_parser, parse_min_max_nnodes

    args = get_args_parser().parse_args([*torchrun_args, "-m", "parallel3d.train"])
    per_node = determine_local_world_size(args.nproc_per_node)
    low, high = parse_min_max_nnodes(args.nnodes)
    return sorted({low * per_node, high * per_node})


def restart_env(torchrun_args: list[str]) -> dict[str, str]:
    """What torchrun's environment needs for ``--max-restarts`` to work (pytorch/pytorch#135712).

    By default torchrun's agent keeps one TCPStore for the whole job and every attempt's workers
    set up their process groups in it, under the same keys: a restarted group can read the
    addresses its dead predecessor left there and fail with "Gloo connectFullMesh failed ...
    Connection refused" (NCCL: a stale unique id). Unshared, each attempt's rank 0 hosts a fresh
    store, as before torch 2.5. Runs without restarts keep torch's default.
    """
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args([*torchrun_args, "-m", "parallel3d.train"])
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if args.max_restarts > 0 else {}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    argv = take_recipes_dir(argv)
    multirun = any(a in sweep.MULTIRUN_FLAGS for a in argv)
    overrides, torchrun_args = split_args([a for a in argv if a not in sweep.MULTIRUN_FLAGS])
    try:
        sizes = world_sizes(torchrun_args)
    except SystemExit:  # argparse already said what was wrong with the torchrun options
        sys.exit(EXIT_CONFIG_ERROR)
    jobs = sweep.plan(overrides) if multirun else []
    exit_if_invalid([job.overrides for job in jobs] or [overrides], sizes, [job.label for job in jobs])
    for key, value in restart_env(torchrun_args).items():
        os.environ.setdefault(key, value)  # a user's own setting wins
    if not multirun:
        sys.stdout.flush()
        os.execv(sys.executable, torchrun_command(torchrun_args, pin_run_dir(overrides)))
    print(f"parallel3d: sweep of {len(jobs)} jobs in {sweep.record(jobs)}", flush=True)
    failed = []
    for n, job in enumerate(jobs):
        print(f"parallel3d: sweep job {n}: {job.label} -> {job.run_dir}", flush=True)
        if subprocess.run(torchrun_command(torchrun_args, job.overrides)).returncode != 0:
            failed.append(n)  # one diverging learning rate must not end the sweep
    if failed:
        print(f"parallel3d: sweep jobs {failed} failed (of {len(jobs)})", file=sys.stderr)
        sys.exit(1)


def take_recipes_dir(argv: list[str]) -> list[str]:
    """``--recipes-dir DIR`` (or ``=DIR``, repeatable): recipes outside the repo, for this process
    and, through PARALLEL3D_RECIPES, every worker torchrun starts. The rest of argv is returned."""
    from parallel3d.config.strict import RECIPES_ENV

    dirs, rest, args = [], [], iter(argv)
    for arg in args:
        if arg == "--recipes-dir":
            dirs.append(next(args, ""))
        elif arg.startswith("--recipes-dir="):
            dirs.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    if dirs:
        known = [p for p in os.environ.get(RECIPES_ENV, "").split(os.pathsep) if p]
        os.environ[RECIPES_ENV] = os.pathsep.join([*(os.path.abspath(d) for d in dirs), *known])
    return rest


def torchrun_command(torchrun_args: list[str], overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "parallel3d.train", *overrides]


def exit_if_invalid(jobs: list[list[str]], sizes: list[int], labels: list[str] | None = None,
                    device: str | None = None) -> None:
    """Exit with one message when any job's config cannot run: before any process starts."""
    for n, job in enumerate(jobs):
        error = first_config_error(job, sizes, device)
        if error:
            where = f" in sweep job {n} ({labels[n]})" if labels else ""
            print(f"parallel3d: config error{where}: {error}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)


def first_config_error(overrides: list[str], sizes: list[int], device: str | None = None) -> str | None:
    """The message of the first problem with these overrides at any of these world sizes, or None."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from parallel3d.base import ConfigError
    from parallel3d.config.compose import compose
    from parallel3d.config.strict import RecipeError
    from parallel3d.validate import check

    for world_size in sizes:
        try:
            check(compose(overrides), world_size, device)
        except ConfigError as e:
            return f"{e} (world size {world_size})" if len(sizes) > 1 else str(e)
        except (HydraException, OmegaConfBaseException, RecipeError) as e:
            return hydra_reason(e)
    return None


def hydra_reason(error: Exception) -> str:
    """Hydra's whole message on one line (its first line alone often lacks the reason)."""
    reason = " ".join(" ".join(line.split()) for line in str(error).splitlines() if line.strip())
    cause = error.__cause__
    if cause is not None and str(cause).strip() and str(cause).split()[0] not in reason:
        reason += f" ({' '.join(str(cause).split())})"
    return reason


def pin_run_dir(overrides: list[str]) -> list[str]:
    """These overrides with ``hydra.run.dir`` resolved now, unless they name a ``run_dir`` already.

    Hydra's default run dir (and any ``${now:...}`` in a user's ``hydra.run.dir``) is evaluated when
    a worker composes its config; a worker started by a restart would get a new, empty folder.
    The pinned path keeps conf/config.yaml's ``p3d.rank0_dir`` wrapper: ranks other than 0 still
    make no folder of their own (other nodes' launchers may have read another second).
    """
    if given_run_dir(overrides) is not None:
        return overrides
    return [*(o for o in overrides if sweep.key_of(o) != "hydra.run.dir"), run_dir_override(hydra_run_dir(overrides))]


if __name__ == "__main__":
    main()
