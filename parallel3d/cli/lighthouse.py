"""parallel3d-lighthouse: torchft's lighthouse for replica groups (docs/fault-tolerance.md).

    parallel3d-lighthouse --min-replicas 1 --port 29510
    # then each replica group, its own job:  ... ft.enabled=true ft.lighthouse=http://HOST:29510 ft.replica_id=K

Prints one line with the address to pass as ``ft.lighthouse`` and serves until stopped (Ctrl-C,
SIGTERM). ``--port 0`` takes a free port (the line says which).
"""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
import threading


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="parallel3d-lighthouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-replicas", type=int, required=True,
                        help="replica groups a quorum needs at least (as ft.min_replicas)")
    parser.add_argument("--port", type=int, default=29510, help="port to listen on; 0: any free port")
    parser.add_argument("--join-timeout-ms", type=int, default=1000,
                        help="how long a quorum waits for more groups once min-replicas are in")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                        help="a group silent this long is left out of the next quorum (a killed group)")
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="how often quorums are computed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.min_replicas < 1:
        print(f"parallel3d-lighthouse: --min-replicas={args.min_replicas}: must be >= 1", file=sys.stderr)
        return 2
    if importlib.util.find_spec("torchft") is None:
        print("parallel3d-lighthouse needs torchft: pip install 'parallel3d[ft]'", file=sys.stderr)
        return 2
    from parallel3d.ft.lighthouse import start_lighthouse

    try:
        server = start_lighthouse(min_replicas=args.min_replicas, port=args.port, join_timeout_ms=args.join_timeout_ms,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms, quorum_tick_ms=args.quorum_tick_ms)
    except Exception as e:  # the port taken, most often
        print(f"parallel3d-lighthouse: cannot listen on port {args.port}: {e}. Fix: another --port", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"parallel3d-lighthouse: serving at {server.address()} (min replicas {args.min_replicas}); "
          f"pass ft.lighthouse={server.address()}", flush=True)
    while not stop.wait(0.5):  # a timed wait: the signal handlers run between waits
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
