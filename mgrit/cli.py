"""The `mgrit` command: `mgrit demo`, `mgrit bench WORKLOAD`."""

from __future__ import annotations

import argparse

from . import bench, demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mgrit", description="Multigrid reduction in time "
                                     "for time stepping and layer-parallel ResNet training.")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_arguments(sub.add_parser("bench", help="run a benchmark workload"))
    demo.add_arguments(sub.add_parser("demo", help="parallel-in-time heat equation solve"))
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            return bench.run(args)
        return demo.run(args)
    except (ValueError, TypeError) as err:
        parser.exit(2, f"mgrit {args.command}: error: {err}\n")


if __name__ == "__main__":
    raise SystemExit(main())
