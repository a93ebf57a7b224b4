"""parallel3d-run: compose and validate the config once, then hand over to torchrun.

    parallel3d-run [torchrun options] [recipe=NAME] [key=value ...]

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
"""

from __future__ import annotations

import os
import sys

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
    overrides, torchrun_args = split_args(argv)
    try:
        sizes = world_sizes(torchrun_args)
    except SystemExit:  # argparse already said what was wrong with the torchrun options
        sys.exit(EXIT_CONFIG_ERROR)
    error = first_config_error(overrides, sizes)
    if error:
        print(f"parallel3d: config error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    overrides = pin_run_dir(overrides)
    for key, value in restart_env(torchrun_args).items():
        os.environ.setdefault(key, value)  # a user's own setting wins
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "parallel3d.train", *overrides]
    sys.stdout.flush()
    os.execv(sys.executable, command)


def first_config_error(overrides: list[str], sizes: list[int]) -> str | None:
    """The message of the first problem with these overrides at any of these world sizes, or None."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from parallel3d.config import compose
    from parallel3d.validate import ConfigError, check

    for world_size in sizes:
        try:
            check(compose(overrides), world_size)
        except ConfigError as e:
            return f"{e} (world size {world_size})" if len(sizes) > 1 else str(e)
        except (HydraException, OmegaConfBaseException) as e:
            return " ".join(str(e).split("\n")[:2]).strip()
    return None


def _sets(override: str, key: str) -> bool:
    return override.lstrip("+").startswith(f"{key}=")


def pin_run_dir(overrides: list[str]) -> list[str]:
    """These overrides with ``hydra.run.dir`` resolved now, unless they name a ``run_dir`` already.

    Hydra's default run dir (and any ``${now:...}`` in a user's ``hydra.run.dir``) is evaluated when
    a worker composes its config; a worker started by a restart would get a new, empty folder.
    The pinned path keeps conf/config.yaml's ``p3d.rank0_dir`` wrapper: ranks other than 0 still
    make no folder of their own (other nodes' launchers may have read another second).
    """
    if any(_sets(o, "run_dir") for o in overrides):
        return overrides
    path = os.path.abspath(hydra_run_dir(overrides))
    quoted = path.replace("\\", "\\\\").replace("'", "\\'")  # an OmegaConf quoted string: any path
    return [*(o for o in overrides if not _sets(o, "hydra.run.dir")), f"hydra.run.dir=${{p3d.rank0_dir:'{quoted}'}}"]


def hydra_run_dir(overrides: list[str]) -> str:
    """``hydra.run.dir`` as rank 0 of a run started now with these overrides would resolve it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from parallel3d.config import CONF_DIR, register_configs
    from parallel3d.train import rank0_dir

    register_configs()
    if not OmegaConf.has_resolver("p3d.rank0_dir"):
        OmegaConf.register_new_resolver("p3d.rank0_dir", rank0_dir)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    return str(cfg.hydra.run.dir)


if __name__ == "__main__":
    main()
