"""`kvsieve engine`: a gRPC server that runs decoder-DSL programs on the attached model.

The model is one and not thread-safe, so programs run one at a time in a worker
thread; events cross to the event loop through a queue. A client that cancels
(or disconnects) stops its program within one decode step, which releases the
program's pins in the store. However a run ends (done, error, or an exception
nobody foresaw), the stream gets a last event and ends: a client never waits
for its deadline.

The engine is a tenant boundary like the sidecar: it listens under the same
rules as `kvsieve serve` (one `ServerConfig`: loopback unless auth tokens are
set, bearer tokens, TLS), and it takes each program's namespace from the
caller's token. It talks to its store with its own token, which may grant many
namespaces, so it must never let a caller pick a namespace its token does not
grant.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from typing_extensions import override

from engine_adapter.dsl import ProgramError, plan
from engine_adapter.dsl.plan import check_args
from engine_adapter.dsl.run import Event, ProgramRun
from engine_adapter.runner import Engine
from kvstore._generated.kvsieve.v1 import engine_pb2 as pb
from kvstore._generated.kvsieve.v1 import engine_pb2_grpc as pb_grpc
from kvstore.errors import InvalidInputError, PermissionDeniedError, UnauthenticatedError
from kvstore.keys import validate_namespace
from kvstore.rpc.channel import channel_options
from kvstore.server.auth import Authorizer
from kvstore.server.config import ServerConfig
from kvstore.server.listen import bind

DEFAULT_LISTEN = "127.0.0.1:50061"


def check_engine_config(config: ServerConfig) -> None:
    """The engine's extra rule on top of `ServerConfig`'s: no bearer tokens in clear on a network.

    `ServerConfig` already refuses a non-loopback address without auth tokens.
    The engine also refuses one without TLS, since its callers' tokens would
    cross the network in clear; `allow_insecure_remote` overrides both.
    """
    if not config.is_loopback and config.tls_cert is None and not config.allow_insecure_remote:
        raise InvalidInputError(
            f"refusing to listen on {config.listen} without TLS: bearer tokens would cross the "
            "network in clear; set tls_cert and tls_key, or allow_insecure_remote"
        )


class TenantScope:
    """Which namespace a caller's program runs in: the one its bearer token grants.

    Args:
        auth_tokens: token -> namespaces it grants ("*" = all), as in `ServerConfig`.
    """

    def __init__(self, auth_tokens: Mapping[str, Iterable[str]]) -> None:
        self._auth = Authorizer(auth_tokens)
        self._grants = {token: sorted(set(grants)) for token, grants in auth_tokens.items()}

    def namespace(self, metadata: Iterable[tuple[str, str | bytes]], requested: str) -> str:
        """The caller's namespace. Raises UnauthenticatedError, PermissionDeniedError.

        A token that grants one namespace runs there (`requested` must be empty or
        that one). A token that grants several (or "*") must name one it grants.
        With no tokens configured (loopback only), `requested` or "default".
        """
        token = self._auth.caller(metadata)
        if token is None:
            validate_namespace(requested or "default")
            return requested or "default"
        grants = self._grants[token]
        if not requested:
            if len(grants) != 1 or grants[0] == "*":
                raise PermissionDeniedError(
                    f"this token grants {grants}: name one of them in RunProgramRequest.namespace"
                )
            return grants[0]
        validate_namespace(requested)
        self._auth.check(token, requested)
        return requested


class EngineServicer(pb_grpc.EngineServicer):
    """RunProgram over one engine; see module docstring."""

    def __init__(self, engine: Engine, scope: TenantScope | None = None) -> None:
        self._engine = engine
        self._scope = scope or TenantScope({})
        self._model_lock = threading.Lock()

    @override
    async def RunProgram(self, request: pb.RunProgramRequest, context: Any) -> AsyncIterator[pb.ProgramEvent]:
        try:
            namespace = self._scope.namespace(context.invocation_metadata(), request.namespace)
            checked = plan(request.source)
            args = check_args(checked, dict(request.args))
        except UnauthenticatedError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            return
        except PermissionDeniedError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            return
        except (ProgramError, InvalidInputError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        stop = threading.Event()

        def send(event: Event | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
                loop.call_soon_threadsafe(queue.put_nowait, event)

        def work() -> None:
            try:
                with self._model_lock:
                    engine = Engine(self._engine.lm, self._engine.store, namespace)
                    run = ProgramRun(engine, checked, args, keep=request.keep, cancelled=stop.is_set)
                    for event in run.events():
                        send(event)
            except Exception as exc:  # the run's own errors are events; this is anything else
                send(Event("error", value=f"{type(exc).__name__}: {exc}"))
            finally:
                send(None)  # the end marker, whatever happened above

        worker = loop.run_in_executor(None, work)
        try:
            while (event := await queue.get()) is not None:
                yield _to_pb(event)
        finally:
            stop.set()  # client gone or done: the program stops within one decode step
            await asyncio.shield(worker)


def _to_pb(event: Event) -> pb.ProgramEvent:
    try:
        value_json = json.dumps(event.value)
    except (TypeError, ValueError):
        value_json = json.dumps(str(event.value))
    return pb.ProgramEvent(kind=event.kind, name=event.name, value_json=value_json, elapsed_s=event.elapsed_s)


@dataclass
class RunningEngine:
    """A started engine server: where it listens and how to stop it."""

    server: grpc.aio.Server
    address: str

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls and let running programs finish for `grace_s`."""
        await self.server.stop(grace_s)


async def start_engine(engine: Engine, config: ServerConfig) -> RunningEngine:
    """Check `config`, bind (TLS when configured) and start serving RunProgram."""
    check_engine_config(config)
    server = grpc.aio.server(
        options=channel_options(config.max_message_bytes),
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    pb_grpc.add_EngineServicer_to_server(EngineServicer(engine, TenantScope(config.auth_tokens)), server)
    address = bind(server, config)
    await server.start()
    return RunningEngine(server, address)


async def serve_engine(engine: Engine, config: ServerConfig) -> None:
    """Serve until SIGTERM/SIGINT, then let running programs finish for `config.grace_s`."""
    running = await start_engine(engine, config)
    tls = "TLS" if config.tls_cert is not None else "plaintext"
    auth = "bearer tokens" if config.auth_tokens else "no auth"
    print(
        f"kvsieve engine serving on {running.address} ({tls}, {auth}; model {engine.lm.spec.name})",
        flush=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop(config.grace_s)
