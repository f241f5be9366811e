"""Command line: ``python -m overlapkit demo`` and ``python -m overlapkit bench NAME``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overlapkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a one-minute tour: ranks, ping-pong, a timeline picture")
    demo.add_argument(
        "--out", default="overlapkit-demo.png", help="where to write the timeline picture"
    )
    demo.add_argument("--world-size", type=int, default=4)

    bench = sub.add_parser("bench", help="benchmarks (tables of times and ratios; CSV/JSON)")
    which = bench.add_subparsers(dest="bench", required=True)
    bl = which.add_parser("launch", help="ok.launch cold/warm against torch.multiprocessing.spawn")
    bl.add_argument("--world-size", type=int, default=4)
    bl.add_argument("--reps", type=int, default=10, help="warm launches")
    bl.add_argument("--cold-reps", type=int, default=3, help="cold launches (fresh processes)")
    bl.add_argument(
        "--spawn-reps", type=int, default=3, help="torch.multiprocessing.spawn runs (0: skip)"
    )
    for p in (bl,):
        p.add_argument("--csv", help="also write the rows to this CSV file")
        p.add_argument("--json", help="also write the rows to this JSON file")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        run(out=args.out, world=args.world_size)
    elif args.bench == "launch":
        from .bench.launch import run

        run(
            world=args.world_size,
            reps=args.reps,
            cold_reps=args.cold_reps,
            spawn_reps=args.spawn_reps,
            csv_path=args.csv,
            json_path=args.json,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
