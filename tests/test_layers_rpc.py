"""Layer-by-layer loads over a real sidecar (the LoadLayers RPC) on loopback.

What the engine gets through `KVClient.open_layers` must equal what the embedded
store's `open_layers` gives: the same summaries (decoded from the same 2-bit codes)
and the exact stored KV of the chunks asked for, at their true positions.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens
from hostile import code_of, raw_stub

from bench.common.sidecar import Sidecar
from importance.lowbit import dequantize, quantize
from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.api import LayeredLoad
from kvstore.client.kvclient import KVClient
from kvstore.errors import InvalidInputError, StoreFullError
from kvstore.rpc.messages import ctx_to_pb

B, C = 32, 8  # the test sidecar's block tokens; per-layer chunk tokens
N = 3 * B
Array = np.ndarray[Any, Any]


@pytest.fixture(scope="module")
def layered_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    config = tmp_path_factory.mktemp("cfg") / "kvsieve.toml"
    config.write_text("[server]\nlayers_idle_s = 2.0\n")
    server = Sidecar(
        tmp_path_factory.mktemp("layers"), ["--layout", "layered", "--config", str(config)]
    ).start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def stored(layered_sidecar: Sidecar) -> tuple[Array, Array]:
    toks, kv = make_tokens(N, seed=3), make_kv(TINY, N, seed=3)
    with KVClient(layered_sidecar.address, use_shm=False) as client:
        assert client.store(toks, kv, model=TINY).new_blocks == 3
    return toks, kv


def test_summaries_and_chunks_over_the_wire_are_the_stored_ones(
    layered_sidecar: Sidecar, stored: tuple[Array, Array]
) -> None:
    toks, kv = stored
    with KVClient(layered_sidecar.address) as client, client.open_layers(toks, model=TINY) as load:
        assert isinstance(load, LayeredLoad)
        assert (load.matched_tokens, load.chunk_tokens, load.num_layers) == (N, C, TINY.num_layers)
        assert 0 < load.summary_bytes < load.prefix_bytes
        for layer in range(TINY.num_layers):
            keys = kv[layer, 0].astype(np.float32)  # (heads, N, dim)
            expected = np.concatenate(
                [dequantize(quantize(keys[:, b : b + B], 2, B)) for b in range(0, N, B)], axis=1
            )
            assert np.array_equal(load.key_summary(layer), expected)
            chosen = [0, 3, 5, 11] if layer == 0 else [1, 2]
            piece = load.read_layer(layer, chosen)
            positions = np.concatenate([np.arange(c * C, (c + 1) * C) for c in chosen])
            assert piece.positions.tolist() == positions.tolist()
            assert piece.kv.tobytes() == np.ascontiguousarray(kv[layer][:, :, positions]).tobytes()
        assert load.delivered_tokens == (4 + 2) * C
        assert load.delivered_fraction == pytest.approx(6 * C / (2 * N))
        assert 0 < load.bytes_read < load.prefix_bytes and load.read_fraction < 1


def test_bad_layer_or_chunks_fail_before_the_wire_and_on_it(
    layered_sidecar: Sidecar, stored: tuple[Array, Array]
) -> None:
    toks, _ = stored
    with KVClient(layered_sidecar.address) as client, client.open_layers(toks, model=TINY) as load:
        for layer in (-1, TINY.num_layers):
            with pytest.raises(InvalidInputError, match="layer"):
                load.key_summary(layer)
        for chunks in ([N // C], [2, 1], [1, 1]):
            with pytest.raises(InvalidInputError, match="chunks"):
                load.read_layer(0, chunks)
        assert load.read_layer(0, [0]).positions.tolist() == list(range(C))  # still usable
    with raw_stub(layered_sidecar.address) as stub:
        opening = pb.LayersOpen(ctx=ctx_to_pb(TINY, "default"), tokens_u32le=toks.astype("<u4").tobytes())
        bad_reads = [
            pb.LayerRead(layer=0, chunks_u32le=np.array([99], "<u4").tobytes()),
            pb.LayerRead(layer=7),
            pb.LayerRead(layer=0, summary=True, chunks_u32le=b"\x00\x00\x00\x00"),
            pb.LayerRead(layer=0, chunks_u32le=b"\x01"),
        ]
        for read in bad_reads:
            requests = [pb.LayersRequest(open=opening), pb.LayersRequest(read=read)]
            code = code_of(lambda r=requests: list(stub.LoadLayers(iter(r), timeout=10)))  # type: ignore[misc]
            assert code == grpc.StatusCode.INVALID_ARGUMENT, read
        no_open = [pb.LayersRequest(read=pb.LayerRead(layer=0, summary=True))]
        code = code_of(lambda: list(stub.LoadLayers(iter(no_open), timeout=10)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_prefix_not_in_the_layered_layout_matches_nothing(layered_sidecar: Sidecar) -> None:
    with (
        KVClient(layered_sidecar.address) as client,
        client.open_layers(make_tokens(N, 99), model=TINY) as load,
    ):
        assert load.matched_tokens == 0
        with pytest.raises(InvalidInputError):
            load.key_summary(0)


def test_an_idle_stream_is_ended_and_the_server_serves_on(
    layered_sidecar: Sidecar, stored: tuple[Array, Array]
) -> None:
    toks, _ = stored
    with KVClient(layered_sidecar.address) as client:
        load = client.open_layers(toks, model=TINY)
        assert load.matched_tokens == N
        time.sleep(2.5)  # past layers_idle_s = 2 of this sidecar
        with pytest.raises(StoreFullError, match="no request"):  # RESOURCE_EXHAUSTED: a server limit
            load.key_summary(0)
        load.close()
        with client.open_layers(toks, model=TINY) as again:  # the server is fine and serves again
            assert again.key_summary(1).shape == (TINY.num_kv_heads, N, TINY.head_dim)


def test_an_importance_layout_sidecar_matches_nothing_layered(tmp_path: Path) -> None:
    toks, kv = make_tokens(N, seed=5), make_kv(TINY, N, seed=5)
    sidecar = Sidecar(tmp_path / "importance", ["--layout", "importance"]).start()  # not the default
    try:
        with KVClient(sidecar.address) as client:
            client.store(toks, kv, model=TINY)
            with client.open_layers(toks, model=TINY) as load:
                assert load.matched_tokens == 0
    finally:
        sidecar.kill()
