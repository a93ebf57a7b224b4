"""parallel3d-run: compose and validate the config once, then hand over to torchrun.

    parallel3d-run [torchrun options] [recipe=NAME] [key=value ...]

Under plain torchrun every rank would print the same config error and torchrun would add a
traceback of its own. This checks the config in one process first, for the world size that the
torchrun options describe, and prints a single message when it cannot run. Otherwise it replaces
itself with ``torchrun [options] -m parallel3d.train [overrides]``: every option torchrun knows
(``--nnodes``, ``--node-rank``, ``--rdzv-backend``, ``--rdzv-endpoint``, ``--max-restarts`` ...)
passes through unchanged.
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


if __name__ == "__main__":
    main()
