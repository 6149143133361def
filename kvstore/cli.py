"""`kvsieve` command line. Subcommands import their modules lazily, so `--help` is instant."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstore.cliflags import add_flags, overrides
from kvstore.config import StoreConfig
from kvstore.errors import KVSieveError
from kvstore.server.config import ServerConfig
from kvstore.settings import build_config


def _benchmarks() -> tuple[str, ...]:
    """Names of the system benchmarks: every `bench/NAME_bench.py`, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("bench")
    folders = spec.submodule_search_locations if spec is not None else None
    names = (p.name.removesuffix("_bench.py") for f in folders or [] for p in Path(f).glob("*_bench.py"))
    return tuple(sorted(names))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvsieve` console script. Returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, KVSieveError) as exc:
        print(f"kvsieve {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsieve",
        description="Tiered KV-cache storage for LLM inference (memory -> LMDB disk -> Redis).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "generate",
        help="answer a prompt with the attached model, reusing cached prefix KV",
        description="Answer PROMPT with SmolLM2-135M-Instruct (or --model), loading cached prefix KV "
        "from an embedded store (--data-dir, default ~/.cache/kvsieve/data) or a sidecar (--store). "
        "Only whole blocks of 256 prompt tokens are cached: ask about a --context document to see reuse "
        "(run the same command twice; -v tells what was loaded instead of computed).",
    )
    p.add_argument("prompt", help="the user message (the question, when --context is given)")
    p.add_argument("--system", help="a system message before it")
    p.add_argument(
        "--context",
        metavar="FILE",
        help="a text document placed before PROMPT in the user message ('-' reads stdin); "
        "its blocks are cached, so later questions about it load them instead of recomputing",
    )
    p.add_argument("--budget", type=float, default=1.0, help="fraction of the cached prefix to load, (0, 1]")
    _add_model_flags(p, no_store=True)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="say where the time went")
    p.set_defaults(handler=_cmd_generate)

    p = sub.add_parser(
        "run",
        help="run a decoder-DSL program on the attached model",
        description="Run PROGRAM (a .kvs file, see examples/) with --arg name=value for each of its "
        "parameters. Yields are printed as they arrive.",
    )
    p.add_argument("program", type=Path, help="the program file")
    p.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE", help="a program argument")
    _add_model_flags(p)
    p.add_argument(
        "--keep", action="store_true", help="keep the program's prefix pinned until its lease expires"
    )
    p.add_argument("--json", action="store_true", help="JSON lines: kind, name, value, elapsed_s")
    p.set_defaults(handler=_cmd_run)

    p = sub.add_parser(
        "engine",
        help="serve RunProgram (decoder-DSL programs) over gRPC on the attached model",
        description="An engine server: runs programs sent over gRPC (proto/kvsieve/v1/engine.proto) "
        "on the model, with prefix KV in a kvsieve sidecar (--store) or an embedded store (--data-dir).",
    )
    _add_model_flags(p, namespace=False)
    p.add_argument("--config", type=Path, help="TOML file with an [engine] table (fields as the flags)")
    # The sidecar's own listening rules and flags (auth tokens, TLS, loopback guard); each
    # program's namespace comes from its caller's token. Default listen: 127.0.0.1:50061.
    add_flags(p, ServerConfig, "engine server", skip=ENGINE_SKIPS)
    p.set_defaults(handler=_cmd_engine)

    p = sub.add_parser(
        "serve",
        help="run the gRPC sidecar (lookup, store, stream KV) over an embedded store",
        description="Run the kvsieve sidecar. Settings come from, lowest first: defaults, the "
        "[server] and [store] tables of --config, KVSIEVE_<FIELD> environment variables "
        "(e.g. KVSIEVE_DATA_DIR), then these flags.",
    )
    p.add_argument("--config", type=Path, help="TOML file with [server] and [store] tables")
    add_flags(p, ServerConfig, "server")
    add_flags(p, StoreConfig, "store")
    p.set_defaults(handler=_cmd_serve)

    p = sub.add_parser("stats", help="print a store's figures: from a running sidecar or a data directory")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HOST:PORT or unix:PATH of a running `kvsieve serve`")
    where.add_argument("--data-dir", type=Path, help="read a data directory directly (no server)")
    p.add_argument("--token", help="bearer token, if the server requires one")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=_cmd_stats)

    p = sub.add_parser(
        "fsck",
        help="verify every chunk checksum and the index of a data directory",
        description="Verify every chunk and metadata record (checksums, key identity), block sizes, "
        "parent links and stray chunks. Exit codes: 0 clean, 1 every problem repaired, 2 problems "
        "left or the store unreadable (damaged file), 3 fsck could not run (no store, directory in use).",
    )
    p.add_argument("--data-dir", type=Path, required=True, help="the store's data directory")
    p.add_argument("--repair", action="store_true", help="remove bad blocks and their descendants")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(handler=_cmd_fsck)

    p = sub.add_parser(
        "relayout",
        help="offline job: re-order blocks whose importance ranking changed",
        description="Rewrite blocks whose top tokens (by current scores) changed by more than "
        "--min-change (1 - Jaccard of the top-quarter sets) since they were laid out, so that "
        "loading the important tokens reads few chunks. Safe to kill at any point. Refuses to run "
        "while a server or store uses the directory.",
    )
    p.add_argument("--data-dir", type=Path, required=True, help="the store's data directory")
    p.add_argument("--min-change", type=float, default=0.2, help="rewrite above this change, in [0, 1] (0.2)")
    p.add_argument("--fraction", type=float, default=0.25, help="top share that defines a layout (0.25)")
    p.add_argument("--dry-run", action="store_true", help="report what would be rewritten; write nothing")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(handler=_cmd_relayout)

    p = sub.add_parser("bench", help="run a system benchmark and print its figures")
    p.add_argument("name", choices=_benchmarks(), help="which benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object (stable keys)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for smoke tests")
    p.add_argument("--plot", type=Path, help="also write a PNG plot (ttft, readamp; needs matplotlib)")
    p.set_defaults(handler=_cmd_bench)
    return parser


def _add_model_flags(p: argparse.ArgumentParser, no_store: bool = False, namespace: bool = True) -> None:
    """Flags of the commands that run the model: where KV lives, whose it is, which model."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--store", metavar="ADDR", help="HOST:PORT or unix:PATH of a running `kvsieve serve`")
    where.add_argument(
        "--data-dir", type=Path, help="embedded store directory (default ~/.cache/kvsieve/data)"
    )
    if no_store:
        where.add_argument("--no-store", action="store_true", help="recompute everything")
    p.add_argument("--token", help="bearer token for --store")
    if namespace:
        p.add_argument("--namespace", default="default", help="tenant / cache salt (default: default)")
    p.add_argument("--model", type=Path, help="a local Hugging Face model directory instead of SmolLM2")


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine_adapter.engine import Engine
    from engine_adapter.model import load_model
    from engine_adapter.sampling import Sampling

    sampling = Sampling(args.max_tokens, args.temperature, args.top_p, args.seed, tuple(args.stop))
    user = args.prompt if args.context is None else f"{_read_context(args.context)}\n\n{args.prompt}"
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": user}
    ]
    lm = load_model(args.model)
    store = _open_store(args)
    try:
        result = Engine(lm, store, namespace=args.namespace).generate(messages, sampling, budget=args.budget)
    finally:
        if store is not None:
            store.close()
    print(result.text)
    if args.verbose:
        t = result.timings
        print(
            f"\nprompt {result.prompt_tokens} tokens: {result.matched_tokens} cached, "
            f"{result.loaded_tokens} loaded (budget {args.budget}), {result.computed_tokens} computed; "
            f"{result.stored_blocks} new blocks stored\n"
            f"lookup {t.lookup_s * 1e3:.1f} ms, load {t.load_s * 1e3:.1f} ms, "
            f"prefill {t.prefill_s * 1e3:.0f} ms, decode {t.decode_s * 1e3:.0f} ms "
            f"({len(result.token_ids)} tokens, {result.finish_reason})",
            file=sys.stderr,
        )
        from engine_adapter.model import cache_dir
        from engine_adapter.reuse import reuse_summary

        rates_file = cache_dir() / "prefill-rates.json"
        print(reuse_summary(result, lm.spec.fingerprint.hex(), rates_file), file=sys.stderr)
    return 0


def _read_context(source: str) -> str:
    """The --context document: a UTF-8 text file, or stdin for '-'. ValueError names the problem."""
    if source == "-":
        text = sys.stdin.read()
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"--context {source!r} is not a readable file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"--context {source!r} is not UTF-8 text ({exc.reason} at byte {exc.start})"
            ) from exc
    if not text.strip():
        raise ValueError(f"--context {source!r} is empty")
    return text.strip()


def _cmd_run(args: argparse.Namespace) -> int:
    from engine_adapter.dsl import plan, run_program
    from engine_adapter.dsl.plan import check_args
    from engine_adapter.engine import Engine
    from engine_adapter.model import load_model

    source = args.program.read_text()
    values = dict(_key_value(item) for item in args.arg)
    check_args(plan(source), values)  # bad programs and arguments fail before the model loads
    store = _open_store(args)
    exit_code = 0
    try:
        engine = Engine(load_model(args.model), store, namespace=args.namespace)
        for event in run_program(engine, source, values, keep=args.keep):
            if args.json:
                print(json.dumps({"kind": event.kind, "name": event.name, "value": event.value,
                                  "elapsed_s": event.elapsed_s}), flush=True)  # fmt: skip
            elif event.kind == "yield":
                value = "\n".join(event.value) if isinstance(event.value, list) else event.value
                print(f"[{event.elapsed_s:7.2f}s] {event.name}: {value}", flush=True)
            elif event.kind == "error":
                print(f"kvsieve run: error: {event.value}", file=sys.stderr)
            exit_code = 1 if event.kind == "error" else exit_code
    except (ValueError, FileNotFoundError, KVSieveError):
        raise  # main prints these (exit 2)
    except Exception as exc:  # one line, never a traceback (a broken model or store directory)
        print(f"kvsieve run: error: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        exit_code = 1
    finally:
        if store is not None:
            store.close()
    return exit_code


ENGINE_SKIPS = ("metrics_listen", "max_store_tokens", "shm")


def _cmd_engine(args: argparse.Namespace) -> int:
    import asyncio

    from engine_adapter.engine import Engine
    from engine_adapter.model import load_model
    from engine_adapter.server import DEFAULT_LISTEN, check_engine_config, serve_engine

    config = _engine_config(args, DEFAULT_LISTEN)
    check_engine_config(config)  # refuse before the model loads
    store = _open_store(args)
    try:
        asyncio.run(serve_engine(Engine(load_model(args.model), store), config))
    finally:
        if store is not None:
            store.close()
    return 0


def _engine_config(args: argparse.Namespace, default_listen: str) -> ServerConfig:
    """The engine's listening rules: its own defaults < the [engine] table of --config < flags.

    KVSIEVE_* variables are not read: they configure the sidecar on the same host.
    """
    import dataclasses
    import tomllib

    table: dict[str, Any] = {}
    if args.config is not None:
        with open(args.config, "rb") as fh:
            table = tomllib.load(fh).get("engine", {})
    allowed = {f.name for f in dataclasses.fields(ServerConfig)} - set(ENGINE_SKIPS)
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ValueError(f"unknown keys {unknown} in {args.config}[engine]; allowed: {sorted(allowed)}")
    values = {"listen": default_listen, "metrics_listen": "", **table, **overrides(args, ServerConfig)}
    return build_config(ServerConfig, env={}, overrides=values)


def _key_value(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise ValueError(f"--arg must be NAME=VALUE, got {item!r}")
    return name, value


def _open_store(args: argparse.Namespace) -> Any:
    """The store a model command uses: a sidecar client, or an embedded store."""
    if getattr(args, "no_store", False):
        return None
    if args.store:
        from kvstore.client import KVClient

        return KVClient(args.store, token=args.token)
    from engine_adapter.model import cache_dir
    from kvstore.store import TieredStore

    data_dir = args.data_dir or build_config(StoreConfig).data_dir or cache_dir() / "data"
    return TieredStore(build_config(StoreConfig, overrides={"data_dir": data_dir}))


def _cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from kvstore.server.app import serve_forever

    server_config = build_config(
        ServerConfig, args.config, overrides=overrides(args, ServerConfig), section="server"
    )
    store_config = build_config(
        StoreConfig, args.config, overrides=overrides(args, StoreConfig), section="store"
    )
    asyncio.run(serve_forever(server_config, store_config))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    if args.target:
        from kvstore.client import KVClient

        with KVClient(args.target, token=args.token) as client:
            stats = client.stats()
    else:
        from kvstore.store import TieredStore

        if not (args.data_dir / "lmdb" / "data.mdb").exists():
            raise FileNotFoundError(f"no kvsieve store under {args.data_dir}")
        with TieredStore(StoreConfig(data_dir=args.data_dir)) as store:
            stats = store.stats()
    if args.json:
        tiers = {name: usage._asdict() for name, usage in stats.tiers.items()}
        print(json.dumps({**asdict(stats), "tiers": tiers}))
        return 0
    print(f"blocks {stats.num_blocks}   active leases {stats.active_leases}")
    for name, usage in stats.tiers.items():
        cap = f"{usage.capacity_bytes / 1e6:.1f} MB" if usage.capacity_bytes else "unbounded"
        used = usage.used_bytes / 1e6
        print(f"  tier {name:7} {used:10.1f} MB of {cap:>12}  {usage.num_blocks} blocks")
    for key in sorted(stats.counters):
        print(f"  {key:28} {stats.counters[key]}")
    if stats.read_amplification:
        amps = sorted(stats.read_amplification)
        print(f"  read amplification p50 {amps[len(amps) // 2]:.3f}  max {amps[-1]:.3f}")
    return 0


def _cmd_fsck(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvstore.fsck import EXIT_CANNOT_RUN, fsck_isolated

    try:
        report = fsck_isolated(
            args.data_dir, repair=args.repair, progress=sys.stderr.isatty() and not args.json
        )
    except Exception as exc:  # fsck promises a message and exit 3, never a traceback
        print(f"kvsieve fsck: cannot run: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if args.json:
        print(json.dumps({**asdict(report), "clean": report.clean, "exit_code": report.exit_code}))
        return report.exit_code
    if report.unreadable:
        print(f"unreadable: {report.unreadable}")
        print(f"nothing can be repaired in place: restore {args.data_dir} or move it aside to start empty")
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


def _cmd_relayout(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from kvstore.relayout import relayout

    show = sys.stderr.isatty() and not args.json
    report = relayout(args.data_dir, args.min_change, args.fraction, args.dry_run, progress=show)
    if args.json:
        print(json.dumps(asdict(report)))
        return 0
    verb = "would rewrite" if report.dry_run else "rewrote"
    print(
        f"examined {report.blocks_examined} blocks ({report.blocks_scored} scored); {verb} "
        f"{report.blocks_rewritten}, {report.bytes_written / 1e6:.1f} MB written; "
        f"removed {report.stale_chunks_removed} stale chunks\n"
        f"expected read amplification at the top {args.fraction:.0%}: "
        f"{report.read_amp_before:.3f} before, {report.read_amp_after:.3f} after"
    )
    if report.corrupt_blocks_skipped:
        print(f"skipped {report.corrupt_blocks_skipped} corrupt blocks: run kvsieve fsck", file=sys.stderr)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"bench.{args.name}_bench")
    result = module.run(quick=args.quick)
    if args.plot:
        from bench import plots

        getattr(plots, f"plot_{args.name}")(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
