"""The `minivllm` command: `run` (the demo), `exercise`, `bench`, `serve` (chapter 11)."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minivllm", description="A small, readable vLLM.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    from minivllm.cli import bench, exercise, run, serve

    run.add_parser(subparsers)
    exercise.add_parser(subparsers)
    bench.add_parser(subparsers)
    serve.add_parser(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
