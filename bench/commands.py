"""`kvsieve bench NAME`: every `bench/NAME_bench.py` is a benchmark, found by its file name.

Contributed through the `kvsieve.commands` entry point (pyproject.toml); kvstore.cli.main
finds this module by name and never imports the package.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from kvstore.cli.flags import Subcommands, add_command
from kvstore.errors import InvalidInputError

BENCH_DIR = Path(__file__).resolve().parent


def register(commands: Subcommands) -> None:
    """Add `bench` to `kvsieve` (the `kvsieve.commands` entry point)."""
    add_command(
        commands, "bench", _bench_flags, _cmd_bench, help="run a system benchmark and print its figures"
    )


def benchmarks() -> tuple[str, ...]:
    """Names of the system benchmarks: every `bench/NAME_bench.py`, found without importing it."""
    return tuple(sorted(p.name.removesuffix("_bench.py") for p in BENCH_DIR.glob("*_bench.py")))


def _bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=benchmarks(), help="which benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object (stable keys)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    p.add_argument(
        "--plot", type=Path, help="also write a PNG plot (ttft, readamp, quality, longdoc; needs matplotlib)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=0,
        metavar="C",
        help="vllm only: also run a stream of requests over shared documents, C in flight "
        "(throughput and TTFT p50/p99 of vLLM alone, with its prefix cache, with kvsieve)",
    )


def _cmd_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"bench.{args.name}_bench")
    if args.concurrency and args.name != "vllm":
        raise InvalidInputError(f"--concurrency applies to `kvsieve bench vllm` only, not {args.name!r}")
    if args.concurrency < 0:
        raise InvalidInputError(f"--concurrency must be >= 1 requests in flight, got {args.concurrency}")
    extra = {"concurrency": args.concurrency} if args.concurrency else {}
    result = module.run(quick=args.quick, **extra)
    if args.plot:
        from bench import plots

        getattr(plots, f"plot_{args.name}")(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    return 0
