"""`kvsieve` command line: the composition root. Nothing imports this module.

It builds kvstore's own commands (serve, stats, fsck, relayout) and adds those of
other packages, found through the `kvsieve.commands` entry-point group: each entry
names a module whose `register(commands)` adds commands with
`kvstore.cli.flags.add_command` (engine_adapter.commands: generate, run, engine;
bench.commands: bench). kvstore never imports those packages, and entry points are the
one way it finds them (docs/architecture.md, "The command line").

Every command's flags are built when it is used and its modules are imported by its
handler, so `kvsieve --help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from pathlib import Path

from kvstore.cli.flags import (
    DeferredParser,
    Subcommands,
    add_command,
    add_flags,
    overrides,
    parameter_default,
)
from kvstore.cli.settings import build_config
from kvstore.config import StoreConfig, store_data_file
from kvstore.errors import KVSieveError
from kvstore.server.config import ServerConfig

ENTRY_POINT_GROUP = "kvsieve.commands"
MISSING_PLUGINS = (
    "no command plugins are installed (entry-point group kvsieve.commands): generate, run, "
    "engine and bench come from there. Reinstall kvsieve (pip install -e .) to write them."
)
#: The exit code of a command whose reader went away (`kvsieve stats | head`): what a shell reports
#: for a process that SIGPIPE ended (128 + 13), as `yes | head` does.
EXIT_PIPE_CLOSED = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvsieve` console script. Returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        code = handler(args)
        sys.stdout.flush()  # here, not at exit: a reader gone by now is the BrokenPipeError below
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # some other pipe or socket: a real error, with its traceback
        # Python ignores SIGPIPE (a socket's reader going away must not kill a server), so a closed
        # stdout is an exception: end quietly, as a command SIGPIPE ended would.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return EXIT_PIPE_CLOSED
    except (ValueError, FileNotFoundError, KVSieveError) as exc:
        print(f"kvsieve {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _parser() -> argparse.ArgumentParser:
    registrars = plugin_registrars()
    parser = argparse.ArgumentParser(
        prog="kvsieve",
        description="Tiered KV-cache storage for LLM inference (memory -> LMDB disk -> Redis).",
        epilog=None if registrars else MISSING_PLUGINS,
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=DeferredParser
    )
    register(commands)
    for plugin in registrars.values():
        plugin(commands)
    return parser


def plugin_registrars() -> dict[str, Callable[[Subcommands], None]]:
    """The `register` function of every installed command plugin, by entry-point name, sorted.

    Entry points are read from the installed metadata, so a checkout installed before a
    plugin was declared lacks it until reinstalled; `--help` then says so.
    """
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return {name: found[name].load() for name in sorted(found)}


def register(commands: Subcommands) -> None:
    """kvstore's own commands: the sidecar and the offline tools over a data directory."""
    add_command(
        commands, "serve", _serve_flags, _cmd_serve,
        help="run the gRPC sidecar (lookup, store, stream KV) over an embedded store",
        description="Run the kvsieve sidecar. Settings come from, lowest first: defaults, the "
        "[server] and [store] tables of --config, KVSIEVE_<FIELD> environment variables "
        "(e.g. KVSIEVE_DATA_DIR), then these flags.",
    )  # fmt: skip
    add_command(
        commands, "stats", _stats_flags, _cmd_stats,
        help="print a store's figures: from a running sidecar or a data directory",
    )  # fmt: skip
    add_command(
        commands, "fsck", _fsck_flags, _cmd_fsck,
        help="verify every chunk checksum and the index of a data directory",
        description="Verify every chunk and metadata record (checksums, key identity), block sizes, "
        "parent links and stray chunks. Exit codes: 0 clean, 1 every problem repaired, 2 problems "
        "left or the store unreadable (damaged file), 3 fsck could not run (no store, directory in use).",
    )  # fmt: skip
    add_command(
        commands, "relayout", _relayout_flags, _cmd_relayout,
        help="offline job: re-order blocks whose importance ranking changed",
        description="Rewrite blocks whose top tokens (by current scores) changed by more than "
        "--min-change (1 - Jaccard of the top-quarter sets) since they were laid out, so that "
        "loading the important tokens reads few chunks. Safe to kill at any point. Refuses to run "
        "while a server or store uses the directory.",
    )  # fmt: skip


def _serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="TOML file with [server] and [store] tables")
    add_flags(p, ServerConfig, "server")
    add_flags(p, StoreConfig, "store")


def _stats_flags(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HOST:PORT or unix:PATH of a running `kvsieve serve`")
    where.add_argument("--data-dir", type=Path, help="read a data directory directly (no server)")
    p.add_argument("--token", help="bearer token, if the server requires one")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _fsck_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, required=True, help="the store's data directory")
    p.add_argument("--repair", action="store_true", help="remove bad blocks and their descendants")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _relayout_flags(p: argparse.ArgumentParser) -> None:
    from kvstore.offline.relayout import relayout

    min_change = parameter_default(relayout, "min_change")
    fraction = parameter_default(relayout, "fraction")
    p.add_argument("--data-dir", type=Path, required=True, help="the store's data directory")
    p.add_argument("--min-change", type=float, default=min_change,
                   help=f"rewrite above this change, in [0, 1] ({min_change})")  # fmt: skip
    p.add_argument("--fraction", type=float, default=fraction,
                   help=f"top share that defines a layout ({fraction})")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="report what would be rewritten; write nothing")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    layer_chunk = parameter_default(relayout, "layer_chunk_tokens")
    p.add_argument("--to-layered", action="store_true",
                   help="migrate importance-layout blocks to the layered layout, and repack "
                        "layered blocks of layout v2 (a value per layer record) as layer packs")  # fmt: skip
    p.add_argument("--layer-chunk-tokens", type=int, default=layer_chunk,
                   help=f"tokens per per-layer chunk of migrated blocks ({layer_chunk})")  # fmt: skip


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
        from kvstore.client.kvclient import KVClient

        with KVClient(args.target, token=args.token) as client:
            stats = client.stats()
    else:
        from kvstore.store.tiered import TieredStore

        if not store_data_file(args.data_dir).exists():
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

    from kvstore.offline.fsck import EXIT_CANNOT_RUN, fsck_isolated

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
    if report.layouts:
        print("layouts: " + ", ".join(f"{n} {kind}" for kind, n in sorted(report.layouts.items())))
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

    from kvstore.offline.relayout import relayout

    show = sys.stderr.isatty() and not args.json
    report = relayout(
        args.data_dir, args.min_change, args.fraction, args.dry_run, progress=show,
        to_layered=args.to_layered, layer_chunk_tokens=args.layer_chunk_tokens,
    )  # fmt: skip
    if args.json:
        print(json.dumps(asdict(report)))
        return 0
    if args.to_layered:
        verb = "would migrate" if report.dry_run else "migrated"
        print(
            f"examined {report.blocks_examined} blocks; {verb} {report.blocks_migrated} to the layered "
            f"layout and repacked {report.blocks_repacked} of layout v2 "
            f"({report.layered_blocks_skipped} already packed), "
            f"{report.bytes_written / 1e6:.1f} MB written"
        )
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


if __name__ == "__main__":
    sys.exit(main())
