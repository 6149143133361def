"""What wraps every servicer call: domain errors mapped to one gRPC status, the streams gauge."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from kvstore.rpc.status import status_of
from kvstore.server.metrics import Metrics


class CallGuard:
    """Maps any error raised inside to a status (kvstore.rpc.status), then aborts."""

    def __init__(self, context: Any) -> None:
        self._context = context

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or isinstance(exc, (asyncio.CancelledError, GeneratorExit, grpc.aio.AbortError)):
            return
        if not isinstance(exc, Exception):
            return
        status = status_of(exc, "KVCache")
        await self._context.abort(status.code, status.details)


class StreamGauge:
    """Counts the call in the active-streams gauge while it runs."""

    def __init__(self, metrics: Metrics) -> None:
        self._gauge = metrics.active_streams

    async def __aenter__(self) -> None:
        self._gauge.inc()

    async def __aexit__(self, *exc: object) -> None:
        self._gauge.dec()
