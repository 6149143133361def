"""A real KV-aware router reads kvsieve's KV events: Dynamo's standalone indexer (a process, from
the venv of bench/events/setup_dynamo.sh) subscribed to a real `kvsieve serve --kv-events`, prefixes
stored through the sidecar with KVClient, and the indexer's `POST /query` compared with the store.

One sidecar and one indexer for the module; the tests run in order (stored, restarted sidecar,
corrupt record, restarted indexer). Skipped without the Dynamo venv unless
KVSIEVE_REQUIRE_DYNAMO=1 (.ci/run builds it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from bench.events.dynamo_indexer import DynamoIndexer, dynamo_python

PYTHON = dynamo_python()
if PYTHON is None:
    if os.environ.get("KVSIEVE_REQUIRE_DYNAMO") == "1":
        pytest.fail(
            "the Dynamo venv is required (KVSIEVE_REQUIRE_DYNAMO=1): bash bench/events/setup_dynamo.sh"
        )
    pytest.skip("Dynamo venv missing (bash bench/events/setup_dynamo.sh)", allow_module_level=True)
from conftest import TINY, corrupt_chunk, make_kv, make_tokens, require_extra  # noqa: E402

require_extra("events")  # the sidecar publishes its events with pyzmq

from bench.common.sidecar import Sidecar, free_port  # noqa: E402
from kvstore.client.kvclient import KVClient  # noqa: E402
from kvstore.config import StoreConfig  # noqa: E402
from kvstore.events.hashing import namespace_salt  # noqa: E402
from kvstore.keys import block_keys, namespace_digest  # noqa: E402
from kvstore.store.tiered import TieredStore  # noqa: E402

pytestmark = pytest.mark.dynamo
BLOCK = 32  # bench.common.sidecar.Sidecar's blocks; the router's are 16 tokens
ROUTER = 16
DISK_BYTES = 40 * BLOCK * TINY.token_bytes  # about 40 blocks of TINY (with their metadata, fewer)


@dataclass
class Fleet:
    sidecar: Sidecar
    indexer: DynamoIndexer
    endpoint: str
    replay: str
    prefixes: list[list[int]]

    def client(self) -> KVClient:
        return KVClient(self.sidecar.address)

    def register(self) -> None:
        self.indexer.register(1, self.endpoint, self.replay, ROUTER)

    def assert_view_equals_store(self) -> None:
        """For every stored prefix, the indexer's match is the sidecar's own lookup."""
        with self.client() as client:
            expected = [client.lookup(p, model=TINY).num_tokens for p in self.prefixes]
        got = [self.indexer.wait_matched(p, e) for p, e in zip(self.prefixes, expected, strict=True)]
        assert got == expected


def keys_of(tokens: list[int]) -> list[bytes]:
    return block_keys(np.asarray(tokens), BLOCK, TINY.fingerprint, namespace_digest("default"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    assert PYTHON is not None
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    args = ["--kv-events", endpoint, "--kv-events-replay", replay, "--kv-events-heartbeat-s", "0.2"]
    args += ["--disk-bytes", str(DISK_BYTES)]  # room for the first tests' blocks; the last evicts
    sidecar = Sidecar(tmp_path_factory.mktemp("sidecar"), args=args).start()
    indexer = DynamoIndexer(PYTHON, tmp_path_factory.mktemp("dynamo") / "indexer.log").start()
    fleet = Fleet(sidecar, indexer, endpoint, replay, [])
    fleet.register()
    yield fleet
    indexer.stop()
    sidecar.kill()


def test_the_indexer_sees_every_stored_prefix(fleet: Fleet) -> None:
    shared = make_tokens(2 * BLOCK, seed=7)
    fleet.prefixes = [make_tokens(3 * BLOCK, seed=s).tolist() for s in range(4)]
    fleet.prefixes.append([*shared.tolist(), *make_tokens(BLOCK, seed=8).tolist()])
    sibling = list(fleet.prefixes[-1])
    sibling[-ROUTER:] = [t + 1 for t in sibling[-ROUTER:]]  # diverges inside a stored block
    fleet.prefixes.append(sibling)
    with fleet.client() as client:
        for tokens in fleet.prefixes:
            client.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
    for tokens in fleet.prefixes:
        assert fleet.indexer.wait_matched(tokens, len(tokens)) == len(tokens)
    other_tail = [*shared.tolist(), *make_tokens(BLOCK, seed=9).tolist()]
    assert fleet.indexer.wait_matched(other_tail, 2 * BLOCK) == 2 * BLOCK  # the shared blocks only
    assert fleet.indexer.matched(make_tokens(3 * BLOCK, seed=99).tolist()) == 0


def test_a_tenant_is_seen_only_with_its_salt(fleet: Fleet) -> None:
    tokens = make_tokens(2 * BLOCK, seed=11).tolist()
    with fleet.client() as client:
        client.store(tokens, make_kv(TINY, len(tokens)), model=TINY, namespace="tenant-a")
    salt = namespace_salt("tenant-a")
    assert fleet.indexer.wait_matched(tokens, len(tokens), cache_salt=salt) == len(tokens)
    assert fleet.indexer.matched(tokens) == 0  # the default namespace's routers never see it


def test_after_a_sidecar_restart_the_view_equals_the_store(fleet: Fleet) -> None:
    """While the sidecar is down a block leaves its data directory: the restarted sidecar's
    snapshot must take it out of the indexer's view (the old run's events said it was held)."""
    fleet.sidecar.kill()
    gone = fleet.prefixes[1]
    with TieredStore(
        StoreConfig(data_dir=fleet.sidecar.data_dir, block_tokens=BLOCK, chunk_tokens=8)
    ) as store:
        store.index.forget(keys_of(gone)[2])
    fleet.sidecar.proc = None
    fleet.sidecar.start()  # same ports and data directory; memory starts empty
    fleet.assert_view_equals_store()
    assert fleet.indexer.matched(gone) == 2 * BLOCK


def test_a_corrupt_record_leaves_the_indexer(fleet: Fleet) -> None:
    victim = fleet.prefixes[0]
    corrupt_chunk(
        StoreConfig(data_dir=fleet.sidecar.data_dir), keys_of(victim)[1], TINY.num_layers
    )  # its layer pack (what a full load reads), on disk, under the sidecar
    with fleet.client() as client:
        client.load_arrays(victim, model=TINY)  # reads it from disk (memory is empty since the restart)
        assert client.lookup(victim, model=TINY).num_tokens == BLOCK
    assert fleet.indexer.wait_matched(victim, BLOCK) == BLOCK
    fleet.assert_view_equals_store()


def test_after_an_indexer_restart_the_view_equals_the_store(fleet: Fleet) -> None:
    fleet.indexer.stop()
    fleet.indexer.start()
    fleet.register()  # its first batch is far past 0: it asks the replay socket, which sends a snapshot
    fleet.assert_view_equals_store()
    assert fleet.indexer.matched(fleet.prefixes[0]) == BLOCK


def test_evicted_blocks_leave_the_indexer(fleet: Fleet) -> None:
    """Prefixes past the disk budget evict the least recently used blocks: the indexer follows."""
    before = len(fleet.prefixes)
    with fleet.client() as client:
        for seed in range(100, 120):
            tokens = make_tokens(3 * BLOCK, seed=seed).tolist()
            client.store(tokens, make_kv(TINY, len(tokens)), model=TINY)
            fleet.prefixes.append(tokens)
        held = [client.lookup(p, model=TINY).num_tokens for p in fleet.prefixes[:before]]
    assert sum(held) < sum(len(p) for p in fleet.prefixes[:before])  # the budget evicted old blocks
    fleet.assert_view_equals_store()
