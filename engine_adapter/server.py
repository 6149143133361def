"""`kvsieve engine`: a gRPC server that runs decoder-DSL programs on the attached model.

The model is one and not thread-safe, so programs run one at a time in a worker
thread; events cross to the event loop through a queue. A client that cancels
(or disconnects) stops its program within one decode step, which releases the
program's pins in the store.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
from typing_extensions import override

from engine_adapter.dsl import ProgramError, plan
from engine_adapter.dsl.plan import check_args
from engine_adapter.dsl.run import Event, ProgramRun
from engine_adapter.engine import Engine
from kvstore._generated.kvsieve.v1 import engine_pb2 as pb
from kvstore._generated.kvsieve.v1 import engine_pb2_grpc as pb_grpc
from kvstore.transport import channel_options


class EngineServicer(pb_grpc.EngineServicer):
    """RunProgram over one engine; see module docstring."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._model_lock = threading.Lock()

    @override
    async def RunProgram(self, request: pb.RunProgramRequest, context: Any) -> AsyncIterator[pb.ProgramEvent]:
        try:
            checked = plan(request.source)
            args = check_args(checked, dict(request.args))
        except ProgramError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        stop = threading.Event()

        def work() -> None:
            with self._model_lock:
                engine = Engine(self._engine.lm, self._engine.store, request.namespace or "default")
                run = ProgramRun(engine, checked, args, keep=request.keep, cancelled=stop.is_set)
                for event in run.events():
                    loop.call_soon_threadsafe(queue.put_nowait, event)
            loop.call_soon_threadsafe(queue.put_nowait, None)

        worker = loop.run_in_executor(None, work)
        try:
            while (event := await queue.get()) is not None:
                yield pb.ProgramEvent(
                    kind=event.kind,
                    name=event.name,
                    value_json=json.dumps(event.value),
                    elapsed_s=event.elapsed_s,
                )
        finally:
            stop.set()  # client gone or done: the program stops within one decode step
            await asyncio.shield(worker)


async def serve_engine(engine: Engine, listen: str, max_message_bytes: int = 64 << 20) -> None:
    """Serve until SIGTERM/SIGINT."""
    server = grpc.aio.server(options=channel_options(max_message_bytes))
    pb_grpc.add_EngineServicer_to_server(EngineServicer(engine), server)
    port = server.add_insecure_port(listen)
    await server.start()
    host = listen.rsplit(":", 1)[0]
    print(f"kvsieve engine serving on {host}:{port} (model {engine.lm.spec.name})", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(10)
