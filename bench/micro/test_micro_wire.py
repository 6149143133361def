"""The protobuf side of one load: a 2,048-token SmolLM2 prefix at budget 0.25 (512 tokens).

Server: request message -> (model, namespace, tokens), then the loaded chunks ->
serialized LoadResponse messages, as the servicer's stream writer builds them.
Client: serialized messages -> LoadedChunk (positions, KV view), as the client's
stream reads them. No socket: what is timed is the conversion, not the transport.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.api import LoadStream
from kvstore.client.arenas import ArenaPool
from kvstore.client.stream import RemoteLoadStream
from kvstore.model import ModelSpec
from kvstore.rpc.messages import ctx_from_pb, ctx_to_pb, tokens_from_pb
from kvstore.server.chunks import ChunkWriter
from kvstore.server.config import ServerConfig
from kvstore.server.servicer import _CHUNKS_PER_MESSAGE
from kvstore.values import LoadedChunk

MODEL = ModelSpec("micro-smollm2", num_layers=30, num_kv_heads=3, head_dim=64)
PREFIX_TOKENS = 2048
SELECTED_TOKENS = 512
CHUNK_TOKENS = 16


@pytest.fixture(scope="module")
def chunks() -> list[LoadedChunk]:
    """The 32 chunks of 16 tokens a budget-0.25 load of the prefix delivers."""
    rng = np.random.default_rng(0)
    kv = rng.standard_normal(MODEL.kv_shape(SELECTED_TOKENS)).astype(np.float16)
    out = []
    for i in range(SELECTED_TOKENS // CHUNK_TOKENS):
        positions = np.arange(i * 64, i * 64 + CHUNK_TOKENS, dtype=np.int64)
        # Contiguous, as the codec decodes a chunk.
        part = np.ascontiguousarray(kv[:, :, :, i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS])
        out.append(LoadedChunk(i // 16, i % 16, positions, part, "memory", part.nbytes))
    return out


def server_side(request: bytes, chunks: list[LoadedChunk]) -> list[bytes]:
    """Decode the request, then encode the chunks into serialized response messages."""
    message = pb.LoadRequest.FromString(request)
    ctx_from_pb(message.ctx)
    tokens_from_pb(message.tokens)
    writer = ChunkWriter(cast(LoadStream, chunks), None, MODEL)
    limit = ServerConfig().max_message_bytes // 2
    out = []
    while response := writer.next_batch(_CHUNKS_PER_MESSAGE, limit):
        out.append(response)  # already serialized (kvstore/server/batch_wire.py)
    return out


def client_side(messages: list[bytes]) -> list[LoadedChunk]:
    """Parse the response messages into chunks, as the client's load stream does."""
    responses = iter([pb.LoadResponse.FromString(m) for m in messages])
    return list(RemoteLoadStream(responses, MODEL, None, ArenaPool(lambda namespace, nbytes: None)))


def load_request() -> bytes:
    tokens = np.random.default_rng(1).integers(0, 49_152, PREFIX_TOKENS)
    return pb.LoadRequest(
        ctx=ctx_to_pb(MODEL, "default"), tokens=tokens.tolist(), budget=0.25
    ).SerializeToString()


def test_load_to_pb(benchmark: Any, chunks: list[LoadedChunk]) -> None:
    messages = benchmark(server_side, load_request(), chunks)
    assert sum(len(pb.LoadResponse.FromString(m).batch.chunks) for m in messages) == len(chunks)


def test_load_from_pb(benchmark: Any, chunks: list[LoadedChunk]) -> None:
    messages = server_side(load_request(), chunks)
    loaded = benchmark(client_side, messages)
    assert [c.positions.tolist() for c in loaded] == [c.positions.tolist() for c in chunks]
    assert all(np.array_equal(a.kv, b.kv) for a, b in zip(loaded, chunks, strict=True))
