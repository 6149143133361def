"""Block metadata is checksummed and identity-checked: a flipped bit in the real LMDB file is a miss.

Each test mutates a metadata record inside data.mdb through lmdb itself (what a bad
disk or a stray write would leave), then checks fsck, a restarted store and
`fsck --repair` over the real CLI.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import lmdb
import numpy as np
import pytest
import xxhash
from conftest import TINY, kvsieve, make_kv, make_tokens

from kvstore.config import StoreConfig
from kvstore.errors import ChecksumError
from kvstore.format.block_meta import BlockMeta
from kvstore.offline.fsck import fsck
from kvstore.store.tiered import TieredStore

PROMPT = make_tokens(96)  # three blocks of 32
OTHER = make_tokens(64, seed=5)  # two blocks, untouched


def fill(config: StoreConfig) -> list[bytes]:
    """Store PROMPT and OTHER; returns PROMPT's block keys."""
    with TieredStore(config) as s:
        s.store(PROMPT, make_kv(TINY, 96), model=TINY)
        s.store(OTHER, make_kv(TINY, 64, 5), model=TINY)
        return [n.key for n in s.tree.match(s._root(TINY, "default"), PROMPT.astype(np.uint32)).nodes]


def rewrite_record(config: StoreConfig, key: bytes, change: Callable[[bytes], bytes]) -> None:
    """Replace the raw metadata record of `key` in data.mdb by `change(record)`."""
    env = lmdb.open(str(config.lmdb_dir), max_dbs=4)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        record = txn.get(key, db=blocks)
        assert record is not None
        txn.put(key, change(bytes(record)), db=blocks)
    env.close()


def flip_token_bit(record: bytes, tokens: Any, token_index: int = 5, bit: int = 0) -> bytes:
    """`record` with one bit of one token id flipped (found by its bytes, not by offsets)."""
    start = record.find(np.asarray(tokens, dtype="<u4").tobytes())
    assert start > 0
    at = start + 4 * token_index
    return record[:at] + bytes([record[at] ^ (1 << bit)]) + record[at + 1 :]


def mutated_prompt(token_index: int = 32 + 5, bit: int = 0) -> np.ndarray:
    tokens = PROMPT.copy()
    tokens[token_index] ^= 1 << bit
    return tokens


def as_version_1(record: bytes) -> bytes:
    """The same record as the previous version wrote it (no checksum)."""
    return BlockMeta.from_bytes(record).to_bytes(version=1)


def assert_detected_and_repaired(config: StoreConfig, key: bytes, detail: str) -> None:
    """fsck reports `key`, a restart serves neither prompt past it, --repair removes it."""
    report = fsck(config.data_dir)  # type: ignore[arg-type]
    bad = [p for p in report.problems if p.kind == "bad-metadata"]
    assert [p.key for p in bad] == [key.hex()] and detail in bad[0].detail
    assert report.exit_code == 2
    with TieredStore(config) as s:
        assert s.stats().counters["metadata_failures"] == 1
        assert s.lookup(mutated_prompt(), model=TINY).num_tokens == 32  # never the original's KV
        assert s.lookup(PROMPT, model=TINY).num_tokens == 32  # block 1 is a miss, block 2 with it
        covered, _positions, kv = s.load_arrays(PROMPT, model=TINY)
        assert covered == 32 and kv.tobytes() == make_kv(TINY, 96)[:, :, :, :32].tobytes()
        assert s.lookup(OTHER, model=TINY).num_tokens == 64
    result = kvsieve("fsck", "--data-dir", str(config.data_dir), "--repair", "--json")
    repaired = json.loads(result.stdout)
    assert result.returncode == 1 and repaired["blocks_removed"] == 2  # block 1 and its child
    assert fsck(config.data_dir).clean  # type: ignore[arg-type]
    with TieredStore(config) as s:
        assert s.stats().counters.get("metadata_failures", 0) == 0
        s.store(PROMPT, make_kv(TINY, 96), model=TINY)  # the prompt can be stored again
        covered, _positions, kv = s.load_arrays(PROMPT, model=TINY)
        assert covered == 96 and kv.tobytes() == make_kv(TINY, 96).tobytes()


def test_flipped_token_bit_in_metadata_fails_its_checksum(small_config: StoreConfig) -> None:
    keys = fill(small_config)
    block = PROMPT[32:64]
    rewrite_record(small_config, keys[1], lambda r: flip_token_bit(r, block))
    assert_detected_and_repaired(small_config, keys[1], "checksum mismatch")


def test_flipped_bit_with_a_recomputed_checksum_fails_the_key_identity(small_config: StoreConfig) -> None:
    keys = fill(small_config)

    def forge(record: bytes) -> bytes:  # a consistent record whose key is not its content's hash
        body = flip_token_bit(record, PROMPT[32:64])[:-8]
        return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")

    rewrite_record(small_config, keys[1], forge)
    assert_detected_and_repaired(small_config, keys[1], "key is not the hash")


def test_version_1_records_are_read_and_identity_checked(small_config: StoreConfig) -> None:
    keys = fill(small_config)
    for key in keys:
        rewrite_record(small_config, key, as_version_1)
    assert fsck(small_config.data_dir).clean  # type: ignore[arg-type]
    with TieredStore(small_config) as s:  # records of the previous version still serve
        covered, _positions, kv = s.load_arrays(PROMPT, model=TINY)
        assert covered == 96 and kv.tobytes() == make_kv(TINY, 96).tobytes()
    rewrite_record(small_config, keys[1], lambda r: flip_token_bit(r, PROMPT[32:64]))
    assert_detected_and_repaired(small_config, keys[1], "key is not the hash")


def test_record_filed_under_another_key_is_refused(small_config: StoreConfig) -> None:
    keys = fill(small_config)
    env = lmdb.open(str(small_config.lmdb_dir), max_dbs=4)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:  # block 2's record copied over block 1's
        txn.put(keys[1], bytes(txn.get(keys[2], db=blocks)), db=blocks)
    env.close()
    assert_detected_and_repaired(small_config, keys[1], "names block")


def test_every_flipped_bit_of_a_record_is_refused(small_config: StoreConfig) -> None:
    keys = fill(small_config)
    with TieredStore(small_config) as s:
        meta = s.durable[0].get_meta(keys[1])
        assert meta is not None
    record = meta.to_bytes()
    for at in range(len(record)):
        for bit in (0, 5):
            flipped = record[:at] + bytes([record[at] ^ (1 << bit)]) + record[at + 1 :]
            with pytest.raises(ChecksumError):
                BlockMeta.from_bytes(flipped)
