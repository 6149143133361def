"""The PrefixStore interface: both implementations satisfy it, the thin client stays thin,
and leases and block information are typed and true on both sides."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from conftest import TINY, make_kv, make_tokens

from bench.common.sidecar import Sidecar
from kvstore.api import LoadStream, PrefixStore, StoreInfo
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore


def test_the_thin_client_imports_no_store_no_lmdb_no_redis() -> None:
    code = (
        "import sys, kvstore.client.kvclient, kvstore.api;"
        "bad = [m for m in ('kvstore.store.tiered', 'kvstore.index.store_index', 'kvstore.load.read',"
        " 'kvstore.store.write', 'lmdb', 'redis', 'torch')"
        " if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_api_module_imports_nothing_heavy() -> None:
    code = (
        "import sys, kvstore.api;"
        "print([m for m in ('grpc', 'lmdb', 'redis', 'torch', 'kvstore.store.tiered') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_embedded_store_lease_and_info(tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path / "d", block_tokens=32, chunk_tokens=8)
    with TieredStore(config) as store:
        assert isinstance(store, PrefixStore)
        assert store.info == StoreInfo(32, 8)
        tokens = make_tokens(70, seed=1)
        store.store(tokens, make_kv(TINY, 70, seed=1), model=TINY)
        before = time.monotonic()
        lease = store.pin(tokens, model=TINY, ttl_s=20)
        assert (lease.num_keys, lease.ttl_s) == (2, 20)
        assert before + 20 <= lease.expires_at <= time.monotonic() + 20
        with store.load(tokens, model=TINY) as stream:
            assert isinstance(stream, LoadStream)
            assert stream.gather(TINY)[0].tolist() == list(range(64))
        store.unpin(lease.lease_id)


def test_client_lease_has_the_real_key_count_and_a_local_deadline(sidecar: Sidecar) -> None:
    with KVClient(sidecar.address) as client:
        assert isinstance(client, PrefixStore)
        assert client.info == StoreInfo(None, None)  # the sidecar drops partial blocks itself
        tokens = make_tokens(100, seed=2)
        client.store(tokens, make_kv(TINY, 100, seed=2), model=TINY, namespace="api")
        before = time.monotonic()
        lease = client.pin(tokens, model=TINY, namespace="api", ttl_s=15)
        assert (lease.num_keys, lease.ttl_s) == (3, 15)
        assert before + 15 <= lease.expires_at <= time.monotonic() + 15
        with client.load(tokens, model=TINY, namespace="api") as stream:
            assert isinstance(stream, LoadStream)
            assert stream.gather(TINY)[0].tolist() == list(range(96))
        client.unpin(lease.lease_id)
