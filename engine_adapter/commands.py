"""The model's commands of `kvsieve`: generate, run and engine.

Contributed through the `kvsieve.commands` entry point (pyproject.toml); kvstore.cli.main
finds this module by name and never imports the package. Each command's flags are
built when that command is used, so the defaults come from the dataclasses that
own them (`Sampling`, `Limits`, `ServerConfig`) without slowing `kvsieve --help`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_adapter.reports import print_budget, print_event, print_layered, print_split, print_timings
from kvstore.budget import AutoBudget, parse_budget, resolve_budget
from kvstore.cli.flags import Subcommands, add_command, add_flags, build_from_flags_and_env, parameter_default
from kvstore.cli.settings import build_config
from kvstore.errors import InvalidInputError, KVSieveError
from kvstore.server.config import ServerConfig

if TYPE_CHECKING:
    pass

ENGINE_SKIPS = ("metrics_listen", "max_store_tokens", "shm")
"""ServerConfig fields that the engine server does not use (no flag, refused in [engine])."""


def register(commands: Subcommands) -> None:
    """Add generate, run and engine to `kvsieve` (the `kvsieve.commands` entry point)."""
    add_command(
        commands, "generate", _generate_flags, _cmd_generate,
        help="answer a prompt with the attached model, reusing cached prefix KV",
        description="Answer PROMPT with SmolLM2-135M-Instruct (or --model), loading cached prefix KV "
        "from an embedded store (--data-dir, default ~/.cache/kvsieve/data) or a sidecar (--store). "
        "Only whole blocks of 256 prompt tokens are cached: ask about a --context document to see reuse "
        "(run the same command twice; -v tells what was loaded instead of computed).",
    )  # fmt: skip
    add_command(
        commands, "run", _run_flags, _cmd_run,
        help="run a decoder-DSL program on the attached model",
        description="Run PROGRAM (a .kvs file, see examples/) with --arg name=value for each of its "
        "parameters. Yields are printed as they arrive. The program limits come from, lowest first: "
        "defaults, KVSIEVE_<LIMIT> environment variables (e.g. KVSIEVE_MAX_CALLS), then the flags.",
    )  # fmt: skip
    add_command(
        commands, "engine", _engine_flags, _cmd_engine,
        help="serve RunProgram (decoder-DSL programs) over gRPC on the attached model",
        description="An engine server: runs programs sent over gRPC (proto/kvsieve/v1/engine.proto) "
        "on the model, with prefix KV in a kvsieve sidecar (--store) or an embedded store (--data-dir).",
    )  # fmt: skip


def _generate_flags(p: argparse.ArgumentParser) -> None:
    from engine_adapter.runner import GENERATE_NO_REPEAT_NGRAM, Engine, Sampling

    budget, sampling = parameter_default(Engine.generate, "budget"), Sampling()
    p.add_argument("prompt", help="the user message (the question, when --context is given)")
    p.add_argument("--system", help="a system message before it")
    p.add_argument(
        "--context",
        metavar="FILE",
        help="a text document placed before PROMPT in the user message ('-' reads stdin); "
        "its blocks are cached, so later questions about it load them instead of recomputing",
    )
    p.add_argument(
        "--budget", type=_budget_arg, default=budget,
        help="fraction of the cached prefix to load, (0, 1] (whole chunks, best first), or 'auto': "
        "the fewest chunks holding --coverage of the estimated attention mass (10-100%% of the prefix). "
        "In the layered layout (the default; KVSIEVE_LAYOUT=importance keeps one static order), a budget "
        "of 0.2 or more with a question of 4+ tokens lets each layer's chunks be chosen by the question's "
        "queries",
    )  # fmt: skip
    choose = parameter_default(Engine, "choose_with_last")
    p.add_argument(
        "--choose-with-last", type=_choose_arg, default=choose, metavar="N|all",
        help="on the layer-by-layer path, the last N new tokens' queries choose each layer's chunks "
        f"(the question, not the document's uncached tail); 'all' = every new token (default {choose})",
    )  # fmt: skip
    p.add_argument(
        "--no-topup", action="store_true",
        help="after a layer-by-layer prefill, do not fetch the chunks each answer token needs "
        "(engine_adapter/runner/topup.py; on by default, within --budget: the prefill keeps a little "
        "of it back)",
    )  # fmt: skip
    p.add_argument(
        "--coverage", type=_fraction_arg, default=None,
        help=f"with --budget auto: attention mass to cover, (0, 1] (default {AutoBudget().coverage})",
    )  # fmt: skip
    _add_model_flags(p, no_store=True)
    p.add_argument("--max-tokens", type=int, default=sampling.max_tokens,
                   help=f"tokens to generate at most (default {sampling.max_tokens})")  # fmt: skip
    p.add_argument("--temperature", type=float, default=sampling.temperature,
                   help=f"0 = greedy (default {sampling.temperature})")  # fmt: skip
    p.add_argument("--top-p", type=float, default=sampling.top_p,
                   help=f"nucleus sampling mass (default {sampling.top_p})")  # fmt: skip
    p.add_argument("--seed", type=int, default=sampling.seed, help="sampling seed")
    p.add_argument("--stop", action="append", default=list(sampling.stop), help="stop string (repeatable)")
    p.add_argument(
        "--no-repeat-ngram", type=int, default=GENERATE_NO_REPEAT_NGRAM, metavar="N",
        help="repetition guard: no run of N tokens appears twice in the answer, so a greedy answer "
        f"cannot loop; 0 = off, the model's plain output (default {GENERATE_NO_REPEAT_NGRAM})",
    )  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true", help="say where the time went")


def _run_flags(p: argparse.ArgumentParser) -> None:
    from engine_adapter.dsl import Limits

    p.add_argument("program", type=Path, help="the program file")
    p.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE", help="a program argument")
    _add_model_flags(p)
    p.add_argument(
        "--keep", action="store_true", help="keep the program's prefix pinned until its lease expires"
    )
    p.add_argument("--json", action="store_true", help="JSON lines: kind, name, value, elapsed_s")
    add_flags(p, Limits, "program limits (also KVSIEVE_<NAME> environment variables)")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    _add_model_flags(p, namespace=False)
    p.add_argument("--config", type=Path, help="TOML file with an [engine] table (fields as the flags)")
    # The sidecar's own listening rules and flags (auth tokens, TLS, loopback guard); each
    # program's namespace comes from its caller's token.
    add_flags(p, ServerConfig, "engine server", skip=ENGINE_SKIPS, defaults=_engine_defaults())


def _engine_defaults() -> dict[str, Any]:
    """Where the engine server's defaults differ from the sidecar's ServerConfig."""
    from engine_adapter.server import DEFAULT_LISTEN

    return {"listen": DEFAULT_LISTEN, "metrics_listen": ""}


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
        from engine_adapter.runner import Engine

        default = parameter_default(Engine, "namespace")
        p.add_argument("--namespace", default=default, help=f"tenant / cache salt (default: {default})")
    p.add_argument("--model", type=Path, help="a local Hugging Face model directory instead of SmolLM2")
    p.add_argument(
        "--device", default="cpu", metavar="cpu|cuda|cuda:N|auto",
        help="where the model computes; loaded KV is copied there layer by layer through pooled pinned "
        "buffers (auto = CUDA when present; default cpu)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
        help="what the model computes in and keeps its KV in (fp32 keeps fp16 KV): auto = fp32 on "
        "the CPU, the checkpoint's half precision on CUDA (bf16 for an fp32 checkpoint); KV of "
        "another dtype is never loaded",
    )  # fmt: skip


#: `generate`'s refusal of a prompt with no text (empty, or only spaces).
EMPTY_PROMPT = "the prompt is empty: give the question to answer, e.g. kvsieve generate 'Hi'"


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine_adapter.runner import Engine, Sampling, load_model, resolve_device

    if not args.prompt.strip():  # before the model loads: an empty question has no answer to wait for
        raise InvalidInputError(EMPTY_PROMPT)
    sampling = Sampling(
        args.max_tokens, args.temperature, args.top_p, args.seed, tuple(args.stop), args.no_repeat_ngram
    )
    user = args.prompt if args.context is None else f"{_read_context(args.context)}\n\n{args.prompt}"
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": user}
    ]
    budget = resolve_budget(args.budget, coverage=args.coverage)  # before the model loads
    lm = load_model(args.model, device=resolve_device(args.device), dtype=args.dtype)
    store = _open_store(args)
    try:
        engine = Engine(
            lm, store, namespace=args.namespace, choose_with_last=args.choose_with_last,
            topup=None if args.no_topup else parameter_default(Engine, "topup"),
        )  # fmt: skip
        result = engine.generate(messages, sampling, budget=budget)
        engine.flush_stores()  # a device's stores run behind the answer: made before the store closes
    finally:
        if store is not None:
            store.close()
    print(result.text)
    if args.verbose:
        print_timings(result, budget, lm.spec.fingerprint.hex(), engine.last_layered)
        print_split(engine.last_split)
        print_budget(budget, engine.last_load)
        print_layered(engine.last_layered)
    if engine.transfer.last_error:
        error = engine.transfer.last_error
        print(f"copy to {lm.device} failed ({error}): prompt recomputed", file=sys.stderr)
    return 0


def _budget_arg(text: str) -> float | AutoBudget:
    try:
        return parse_budget(text)
    except InvalidInputError as exc:  # argparse shows only its own text for a ValueError
        raise argparse.ArgumentTypeError(str(exc)) from None


def _choose_arg(text: str) -> int | None:
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"choose-with-last must be a whole number >= 1 or 'all', got {text!r}"
        )
    return int(text)


def _fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"coverage must be a fraction in (0, 1], got {text!r}")
    return value


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
    from engine_adapter.dsl import Limits, plan, run_program
    from engine_adapter.dsl.plan import check_args
    from engine_adapter.runner import Engine, load_model, resolve_device

    limits = build_from_flags_and_env(Limits, args, check=_positive)
    source = args.program.read_text()
    values = dict(_key_value(item) for item in args.arg)
    check_args(plan(source, limits), values)  # bad programs and arguments fail before the model loads
    device = resolve_device(args.device)
    store = _open_store(args)
    exit_code = 0
    try:
        engine = Engine(
            load_model(args.model, device=device, dtype=args.dtype), store, namespace=args.namespace
        )
        for event in run_program(engine, source, values, limits=limits, keep=args.keep):
            print_event(event, args.json)
            exit_code = 1 if event.kind == "error" else exit_code
        engine.flush_stores()
    except (ValueError, FileNotFoundError, KVSieveError):
        raise  # main prints these (exit 2)
    except Exception as exc:  # one line, never a traceback (a broken model or store directory)
        print(f"kvsieve run: error: {type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        exit_code = 1
    finally:
        if store is not None:
            store.close()
    return exit_code


def _positive(name: str, value: Any) -> None:
    """Every DSL limit is a count or a time that must be above zero."""
    if not value > 0:
        raise ValueError(f"{name} must be > 0")


def _cmd_engine(args: argparse.Namespace) -> int:
    import asyncio

    from engine_adapter.runner import Engine, load_model, resolve_device
    from engine_adapter.server import check_engine_config, serve_engine

    config = _engine_config(args)
    check_engine_config(config)  # refuse before the model loads
    device = resolve_device(args.device)
    store = _open_store(args)
    try:
        engine = Engine(load_model(args.model, device=device, dtype=args.dtype), store)
        asyncio.run(serve_engine(engine, config))
        engine.flush_stores()
    finally:
        if store is not None:
            store.close()
    return 0


def _engine_config(args: argparse.Namespace) -> ServerConfig:
    """The engine's listening rules: its own defaults < the [engine] table of --config < flags.

    KVSIEVE_* variables are not read: they configure the sidecar on the same host.
    """
    import dataclasses
    import tomllib

    from kvstore.cli.flags import overrides

    table: dict[str, Any] = {}
    if args.config is not None:
        with open(args.config, "rb") as fh:
            table = tomllib.load(fh).get("engine", {})
    allowed = {f.name for f in dataclasses.fields(ServerConfig)} - set(ENGINE_SKIPS)
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ValueError(f"unknown keys {unknown} in {args.config}[engine]; allowed: {sorted(allowed)}")
    values = {**_engine_defaults(), **table, **overrides(args, ServerConfig)}
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
        from kvstore.client.kvclient import KVClient

        return KVClient(args.store, token=args.token)
    from engine_adapter.runner import cache_dir
    from kvstore.config import StoreConfig
    from kvstore.store.tiered import TieredStore

    data_dir = args.data_dir or build_config(StoreConfig).data_dir or cache_dir() / "data"
    return TieredStore(build_config(StoreConfig, overrides={"data_dir": data_dir}))
