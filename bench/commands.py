"""`kvsieve bench NAME`: one system benchmark, named in BENCHMARKS, run and its figures printed.

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

#: NAME -> the module whose `run(quick=...)` measures it. Names of modules, not modules: parsing
#: the command line imports none of them (between them they pull torch, transformers, vLLM,
#: redis and pyzmq), and only the one asked for is imported when the command runs.
BENCHMARKS: dict[str, str] = {
    "chaos": "bench.chaos.chaos_bench",
    "dsl": "bench.dsl.dsl_bench",
    "events": "bench.events.events_bench",
    "gpu": "bench.datapath.gpu_bench",
    "layers": "bench.datapath.layers_bench",
    "layout": "bench.datapath.layout_bench",
    "longdoc": "bench.quality.longdoc_bench",
    "quality": "bench.quality.quality_bench",
    "radix": "bench.sglang.radix_bench",
    "readamp": "bench.datapath.readamp_bench",
    "remote": "bench.datapath.remote_bench",
    "sglang": "bench.sglang.sglang_bench",
    "store": "bench.datapath.store_bench",
    "transfer": "bench.datapath.transfer_bench",
    "ttft": "bench.datapath.ttft_bench",
    "vllm": "bench.vllm.vllm_bench",
}
#: The benchmarks `--plot` draws (bench/common/plots.py has `plot_NAME` for each).
PLOTTED = ("ttft", "readamp", "quality", "longdoc")
#: The benchmarks whose models run in a dtype `--dtype` names (their `run` takes `dtype`).
DTYPED = ("gpu",)


def register(commands: Subcommands) -> None:
    """Add `bench` to `kvsieve` (the `kvsieve.commands` entry point)."""
    add_command(
        commands, "bench", _bench_flags, _cmd_bench, help="run a system benchmark and print its figures"
    )


def _bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object (stable keys)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    p.add_argument(
        "--plot", type=Path, help=f"also write a PNG plot ({', '.join(PLOTTED)}; needs matplotlib)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=0,
        metavar="C",
        help="vllm only: also run a stream of requests over shared documents, C in flight "
        "(throughput and TTFT p50/p99 of vLLM alone, with its prefix cache, with kvsieve)",
    )
    p.add_argument(
        "--dtype", choices=("float16", "bfloat16"),
        help=f"{', '.join(DTYPED)} only: the half precision its models run in (default float16)",
    )  # fmt: skip


def _cmd_bench(args: argparse.Namespace) -> int:
    _check_flags(args)
    module = importlib.import_module(BENCHMARKS[args.name])
    extra: dict[str, object] = {"concurrency": args.concurrency} if args.concurrency else {}
    if args.dtype:
        extra["dtype"] = args.dtype
    result = module.run(quick=args.quick, **extra)
    if args.plot:
        from bench.common import plots

        getattr(plots, f"plot_{args.name}")(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse flags the benchmark cannot honour before it runs (some run for many minutes)."""
    if args.concurrency and args.name != "vllm":
        raise InvalidInputError(f"--concurrency applies to `kvsieve bench vllm` only, not {args.name!r}")
    if args.concurrency < 0:
        raise InvalidInputError(f"--concurrency must be >= 1 requests in flight, got {args.concurrency}")
    if args.dtype and args.name not in DTYPED:
        raise InvalidInputError(f"--dtype applies to {', '.join(DTYPED)} only, not {args.name!r}")
    if args.plot and args.name not in PLOTTED:
        raise InvalidInputError(f"--plot draws {', '.join(PLOTTED)} only, not {args.name!r}")
