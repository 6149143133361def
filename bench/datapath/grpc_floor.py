"""The floor of a gRPC stream in Python: a bare grpc.aio server streaming prebuilt bytes.

`kvsieve bench transfer` runs it as its own process (`python -m bench.datapath.grpc_floor SIZE
COUNT`): one unary-stream method whose messages are `COUNT` byte strings of `SIZE`
bytes, with no protobuf (identity serializers) and no work per message. What a client
receives from it per second is what grpcio itself gives on this machine, the bound on
any Load stream, which also parses messages and copies the KV out.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvstore.rpc.channel import channel_options

METHOD = "/kvsieve.bench.Floor/Stream"


def serve(size: int, count: int) -> None:
    """Serve until killed; prints `PORT <n>` once listening on 127.0.0.1."""
    payload = bytes(size)

    async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for _ in range(count):
            yield payload

    async def main() -> None:
        server = grpc.aio.server(options=channel_options(64 << 20))
        handler = grpc.method_handlers_generic_handler(
            "kvsieve.bench.Floor", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"PORT {port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
