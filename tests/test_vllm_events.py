"""KV events of the vLLM connector: kvsieve's blocks in vLLM's own hash space and wire format.

Real vLLM objects throughout: requests hashed by vLLM's block hasher, vLLM's `BlockPool`
as the reference for what vLLM itself announces for the same blocks, and vLLM's msgspec
encoder/decoder for the wire round trip. No vLLM process.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVSIEVE_REQUIRE_VLLM") == "1":
        pytest.fail("vLLM is required (KVSIEVE_REQUIRE_VLLM=1) but not installed", pytrace=False)
    pytest.skip("vLLM not installed (pip install -e '.[vllm]', see docs/vllm.md)", allow_module_level=True)

import msgspec
from vllm.config import VllmConfig
from vllm.config.cache import CacheConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import MEDIUM_GPU, MEDIUM_STORAGE, BlockStored, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

from engine_adapter.vllm.connector import held_block_events
from engine_adapter.vllm.events import HeldBlockEvents
from engine_adapter.vllm.plan import RequestTracker, ScheduledRequest
from engine_adapter.vllm.settings import ConnectorSettings
from kvstore.errors import InvalidInputError

pytestmark = pytest.mark.vllm

BLOCK = 16


@pytest.fixture(scope="module")
def hasher():  # type: ignore[no-untyped-def]
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


def _request(hasher, req_id: str, prompt: list[int], **kwargs) -> Request:  # type: ignore[no-untyped-def]
    return Request(req_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher, **kwargs)


def _vllm_own_event(request: Request, start: int, end: int) -> BlockStored:
    """What vLLM's block pool announces for blocks [start, end) of `request` (medium GPU)."""
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(end)
    if start:
        pool.cache_full_blocks(request, blocks, 0, start, BLOCK, 0)
        pool.take_events()
    pool.cache_full_blocks(request, blocks, start, end, BLOCK, 0)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    return event


def _wire_round_trip(events: list) -> list:  # type: ignore[type-arg]
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))
    return msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload).events


def test_a_hit_is_announced_with_vllms_own_hashes_on_the_storage_tier(hasher) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(1000, 1000 + 5 * BLOCK + 3))
    request = _request(hasher, "r1", prompt)
    events = HeldBlockEvents(BLOCK)
    events.announce(request, 0, 4)  # kvsieve holds the first 64 tokens

    (ours,) = events.take()
    assert isinstance(ours, BlockStored)
    vllm = _vllm_own_event(request, 0, 4)
    assert ours.block_hashes == vllm.block_hashes and len(ours.block_hashes) == 4
    assert ours.token_ids == prompt[: 4 * BLOCK] == vllm.token_ids
    assert (ours.parent_block_hash, ours.block_size, ours.lora_name) == (None, BLOCK, None)
    assert (ours.medium, vllm.medium) == (MEDIUM_STORAGE, MEDIUM_GPU)
    assert _wire_round_trip([ours]) == [ours]
    assert events.take() == []  # drained once


def test_saved_blocks_chain_to_their_parent_like_vllms_events(hasher) -> None:  # type: ignore[no-untyped-def]
    request = _request(hasher, "r2", list(range(7 * BLOCK)))
    events = HeldBlockEvents(BLOCK)
    events.announce(request, 2, 6)
    (ours,) = events.take()
    vllm = _vllm_own_event(request, 2, 6)
    assert ours.parent_block_hash == vllm.parent_block_hash is not None
    assert ours.block_hashes == vllm.block_hashes
    assert ours.token_ids == list(range(2 * BLOCK, 6 * BLOCK))


def test_lora_and_cache_salt_are_carried_as_vllm_carries_them(hasher) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(3 * BLOCK))
    lora = LoRARequest("adapter-a", 7, "/nonexistent/adapter-a")
    request = _request(hasher, "r3", prompt, lora_request=lora, cache_salt="tenant-salt")
    plain = _request(hasher, "r4", prompt)
    events = HeldBlockEvents(BLOCK)
    events.announce(request, 0, 3)
    (ours,) = events.take()
    vllm = _vllm_own_event(request, 0, 3)
    assert (ours.lora_name, ours.lora_id) == ("adapter-a", 7)
    assert ours.extra_keys == vllm.extra_keys and ours.extra_keys is not None
    assert "tenant-salt" in ours.extra_keys[0]
    assert ours.block_hashes == vllm.block_hashes
    assert set(ours.block_hashes).isdisjoint(_vllm_own_event(plain, 0, 3).block_hashes)
    assert _wire_round_trip([ours]) == [ours]


def test_blocks_beyond_the_hashed_prompt_are_left_out(hasher) -> None:  # type: ignore[no-untyped-def]
    request = _request(hasher, "r5", list(range(2 * BLOCK + 5)))
    events = HeldBlockEvents(BLOCK)
    events.announce(request, 0, 9)
    events.announce(request, 2, 3)  # nothing hashed there: no event
    (ours,) = events.take()
    assert len(ours.block_hashes) == 2 and len(ours.token_ids) == 2 * BLOCK


def test_undrained_events_are_bounded_and_the_oldest_dropped_counted(hasher) -> None:  # type: ignore[no-untyped-def]
    events = HeldBlockEvents(BLOCK, capacity=3)
    requests = [_request(hasher, f"b{i}", [i] * (2 * BLOCK)) for i in range(5)]
    for request in requests:
        events.announce(request, 0, 2)
    assert (len(events), events.dropped) == (3, 2)
    taken = events.take()
    assert [e.token_ids[0] for e in taken] == [2, 3, 4]
    assert len(events) == 0 and events.dropped == 2
    with pytest.raises(ValueError, match="capacity"):
        HeldBlockEvents(BLOCK, capacity=0)


def test_tracker_reports_the_span_a_save_sent() -> None:
    tracker = RequestTracker(BLOCK, 64, loads=True, saves=True)
    tracker.on_lookup("s", list(range(200)), 64)
    assert tracker.saved_span("s") is None
    tracker.plan([ScheduledRequest("s", 64, 136, tuple(range(13)), replace=True)])
    assert tracker.saved_span("s") == (64, 192)
    tracker.forget("s")
    assert tracker.saved_span("s") is None


def test_events_follow_vllms_kv_events_setting_and_ours() -> None:
    cache = CacheConfig(block_size=BLOCK)
    on = VllmConfig(cache_config=cache, kv_events_config=KVEventsConfig(enable_kv_cache_events=True))
    off = VllmConfig(cache_config=cache, kv_events_config=KVEventsConfig(enable_kv_cache_events=False))
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[])
    queue = held_block_events(on, kv_cache_config, ConnectorSettings(kv_events_queue=5))
    assert queue is not None and (queue.capacity, queue.block_size, queue.medium) == (5, BLOCK, "STORAGE")
    assert held_block_events(off, kv_cache_config, ConnectorSettings()) is None
    assert held_block_events(on, kv_cache_config, ConnectorSettings(kv_events=False)) is None


@pytest.mark.parametrize("extra", [{"kv_events": "yes"}, {"kv_events_queue": 0}, {"kv_events_queue": True}])
def test_event_settings_refuse_bad_values_naming_the_field(extra: dict[str, object]) -> None:
    with pytest.raises(InvalidInputError, match=next(iter(extra))):
        ConnectorSettings.from_extra_config(extra)
