"""`kvsieve` command line. Subcommands import their modules lazily, so `--help` is instant."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

BENCHMARKS = ("store",)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvsieve` console script. Returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvsieve {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsieve",
        description="Tiered KV-cache storage for LLM inference (memory -> LMDB disk -> Redis).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("fsck", help="verify every chunk checksum and the index of a data directory")
    p.add_argument("--data-dir", type=Path, required=True, help="the store's data directory")
    p.add_argument("--repair", action="store_true", help="remove bad blocks and their descendants")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(handler=_cmd_fsck)

    p = sub.add_parser("bench", help="run a system benchmark and print its figures")
    p.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object (stable keys)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    p.set_defaults(handler=_cmd_bench)
    return parser


def _cmd_fsck(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvstore.fsck import fsck

    report = fsck(args.data_dir, repair=args.repair, progress=sys.stderr.isatty() and not args.json)
    if args.json:
        print(json.dumps({**asdict(report), "clean": report.clean, "exit_code": report.exit_code}))
        return report.exit_code
    print(f"checked {report.blocks_checked} blocks, {report.chunks_checked} chunks")
    for problem in report.problems:
        print(f"  {problem.kind:14} {problem.key}  {problem.detail}")
    if report.clean:
        print("clean")
    elif report.repaired:
        print(f"repaired: removed {report.blocks_removed} blocks, {report.chunks_removed} chunks")
    else:
        print(f"{len(report.problems)} problems; run with --repair to remove bad blocks")
    return report.exit_code


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"bench.{args.name}_bench")
    result = module.run(quick=args.quick)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
