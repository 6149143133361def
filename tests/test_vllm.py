"""KVSieveConnector inside the real vLLM (CPU build), SmolLM2, and a real `kvsieve serve`.

No mocks: vLLM runs in driver processes (engine_adapter/vllm/driver.py) started
once per module and shared by the tests, which run in order: a baseline vLLM
without the connector answers every prompt first; process A (with the
connector) answers them twice; the sidecar restarts (memory dropped) and a new
process B answers from its disk; A and B share blocks; the sidecar stops and A
still answers. vLLM runs in float32 and without torch.compile: float32 so that
greedy answers cannot flip on a near-tie between two summation orders (bfloat16
does flip, with vLLM's own prefix cache too), eager so a start takes seconds.

Skipped when vLLM is not installed, unless KVSIEVE_REQUIRE_VLLM=1 (.ci/run).
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVSIEVE_REQUIRE_VLLM") == "1":
        pytest.fail("vLLM is required (KVSIEVE_REQUIRE_VLLM=1) but not installed", pytrace=False)
    pytest.skip("vLLM not installed (pip install -e '.[vllm]', see docs/vllm.md)", allow_module_level=True)

import numpy as np
from conftest import corrupt_chunk

from bench.common.sidecar import Sidecar
from bench.common.texts import token_windows
from engine_adapter.vllm.driver import DriverProcess
from engine_adapter.vllm.timings import read_records
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.keys import block_keys, namespace_digest
from kvstore.model import ModelSpec
from kvstore.stats import StoreStats

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPT_TOKENS = 1100  # 4 whole kvsieve blocks of 256 and a tail vLLM computes
BLOCKS_PER_PROMPT = PROMPT_TOKENS // 256
# records a full load reads per block: its layer pack (the default, layered layout; 256 // 16 chunks
# in the importance layout)
RECORDS_PER_BLOCK = 1
MAX_TOKENS = 12
WARNING = "kvsieve sidecar lookup failed"
NAMESPACE = "test-vllm"


@dataclass
class World:
    """What the tests share: the model, prompts, the sidecar, process A and the baseline answers."""

    model: Path
    prompts: list[list[int]]
    baseline: list[list[int]]
    sidecar: Sidecar
    a: DriverProcess
    logs: Path
    events_endpoint: str  # process A's KV event stream (vLLM's ZMQ publisher)

    def stats(self) -> StoreStats:
        with KVClient(self.sidecar.address) as client:
            return client.stats()

    def settled(self, blocks_written: int, timeout_s: float = 60) -> StoreStats:
        """The sidecar's stats once it counts `blocks_written` (saves are sent in the background)."""
        deadline = time.monotonic() + timeout_s
        while (stats := self.stats()).get("blocks_written") < blocks_written and time.monotonic() < deadline:
            time.sleep(0.05)
        return stats

    def start(self, name: str, **extra: Any) -> DriverProcess:
        return DriverProcess(
            self.model, connector_config(self.sidecar.address, **extra), **driver_options(self.logs, name)
        )


def connector_config(address: str, **extra: Any) -> dict[str, Any]:
    """The --kv-transfer-config of docs/vllm.md, pointed at `address` (plus `extra` settings)."""
    return {
        "kv_connector": "KVSieveConnector",
        "kv_connector_module_path": "engine_adapter.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store": address,
            "namespace": NAMESPACE,
            "retry_after_s": 600,
            **extra,
        },
    }


def events_config(endpoint: str) -> dict[str, Any]:
    """vLLM's own KV events on a ZMQ PUB socket at `endpoint`."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}


def storage_events(subscriber: Any, wanted: int, timeout_s: float = 30) -> list[Any]:
    """`BlockStored` events on kvsieve's tier (medium STORAGE) read from vLLM's stream, until
    `wanted` arrived or the stream stayed silent for `timeout_s`."""
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    found: list[Any] = []
    while len(found) < wanted and subscriber.poll(timeout_s * 1000):
        _topic, _seq, payload = subscriber.recv_multipart()
        batch = decoder.decode(payload)
        found += [e for e in batch.events if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    return found


def model_spec(world: World, kv_dtype: str) -> ModelSpec:
    """The spec our engine's function gives this model directory with KV in `kv_dtype`."""
    from transformers import AutoConfig

    from engine_adapter.runner.model import spec_from_config

    return spec_from_config(
        AutoConfig.from_pretrained(world.model, local_files_only=True), world.model, kv_dtype
    )


def driver_options(logs: Path, name: str) -> dict[str, Any]:
    return {"eager": True, "dtype": "float32", "max_model_len": 2048, "log_path": logs / f"{name}.log"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    model, tokenizer = lm.source, lm.tokenizer
    del lm
    prompts = [ids for _, ids in token_windows(tokenizer, PROMPT_TOKENS, 5)]
    assert len(prompts) == 5 and all(len(p) == PROMPT_TOKENS for p in prompts)
    tmp = tmp_path_factory.mktemp("vllm")
    sidecar = Sidecar(tmp / "data", args=["--block-tokens", "256", "--chunk-tokens", "16"]).start()
    # Both starts overlap: the baseline (no connector) and process A (connector).
    baseline_proc = DriverProcess(model, None, **driver_options(tmp, "baseline"))
    events_endpoint = f"ipc://{tmp}/kv-events"
    events = events_config(events_endpoint)
    a = DriverProcess(
        model, connector_config(sidecar.address), kv_events_config=events, **driver_options(tmp, "a")
    )
    try:
        baseline_proc.wait_ready()
        baseline = baseline_proc.ask(prompts, MAX_TOKENS)["outputs"]
        assert baseline_proc.stop() == 0
        a.wait_ready()
        yield World(model, prompts, baseline, sidecar, a, tmp, events_endpoint)
    finally:
        baseline_proc.stop(timeout_s=10)
        a.stop()
        sidecar.kill()


def test_outputs_identical_with_and_without_connector_while_blocks_load(world: World) -> None:
    import zmq

    prompts = world.prompts[:3]
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.connect(world.events_endpoint)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    first = world.a.ask(prompts, MAX_TOKENS)["outputs"]  # nothing cached yet: computed and stored
    stored = world.settled(3 * BLOCKS_PER_PROMPT)
    assert stored.get("blocks_written") == 3 * BLOCKS_PER_PROMPT
    saved_events = storage_events(subscriber, 3)  # the saves, announced as the requests finished
    second = world.a.ask(prompts, MAX_TOKENS)["outputs"]  # loaded from the sidecar
    hit_events = storage_events(subscriber, 3)  # the lookup hits, in vLLM's own stream
    subscriber.close(linger=0)
    whole = BLOCKS_PER_PROMPT * 256
    assert sorted(e.token_ids for e in hit_events) == sorted(p[:whole] for p in prompts)
    assert all(
        len(e.block_hashes) * e.block_size == whole and e.parent_block_hash is None for e in hit_events
    )
    assert {tuple(e.block_hashes) for e in saved_events} == {tuple(e.block_hashes) for e in hit_events}
    loaded = world.stats()
    assert first == world.baseline[:3]
    assert second == world.baseline[:3]
    assert loaded.get("loads") - stored.get("loads") == 3
    assert (
        loaded.get("chunk_hits.memory") - stored.get("chunk_hits.memory")
        == 3 * BLOCKS_PER_PROMPT * RECORDS_PER_BLOCK
    )
    assert loaded.get("blocks_written") == stored.get("blocks_written")  # nothing stored twice


def test_fingerprint_is_our_engines_for_the_same_model_and_dtype(world: World) -> None:
    assert any(model_spec(world, "float32").fingerprint.hex() in line for line in world.a.log_lines)
    assert model_spec(world, "float32").fingerprint != model_spec(world, "float16").fingerprint


def test_new_process_after_restarts_gets_prefix_from_sidecar_disk(world: World) -> None:
    world.sidecar.kill()  # its memory tier is gone: blocks come back from LMDB
    # A corrupt layer pack in the third block of the first prompt: vLLM must recompute from there.
    spec = model_spec(world, "float32")
    keys = block_keys(
        np.asarray(world.prompts[0], np.uint32), 256, spec.fingerprint, namespace_digest(NAMESPACE)
    )
    corrupt_chunk(StoreConfig(data_dir=world.sidecar.data_dir), keys[2], chunk_index=spec.num_layers)
    world.sidecar.start()
    timings = world.logs / "b-timings.jsonl"
    b = world.start("b", timings_path=str(timings))
    try:
        b.wait_ready()
        answers = b.ask(world.prompts[:3], MAX_TOKENS)["outputs"]
        stats = world.stats()
        assert answers == world.baseline[:3]
        assert stats.get("loads") == 3
        assert stats.get("checksum_failures") == 1
        whole = 3 * BLOCKS_PER_PROMPT * RECORDS_PER_BLOCK
        assert whole - 2 * RECORDS_PER_BLOCK <= stats.get("chunk_hits.lmdb") < whole
        assert stats.get("blocks_written") == 0
        short = [line for line in b.log_lines if "kvsieve sidecar delivered 512 of 1024" in line]
        assert len(short) == 1, short
        # Where the loads' time went (`kvsieve bench vllm`'s breakdown): one lookup per prompt,
        # one load each, the short one delivering half of its blocks.
        records, _ = read_records(timings)
        lookups = [r for r in records if r["what"] == "lookup"]
        loads = [r for r in records if r["what"] == "load"]
        assert [r["hit_tokens"] for r in lookups] == [1024, 1024, 1024]
        assert sorted(r["tokens"] for r in loads) == [512, 1024, 1024]
        assert all(r["s"] > 0 for r in lookups)
        assert all(r["fetch_s"] > 0 and r["copy_s"] > 0 for r in loads)

        # The same prompts sent as a stream, two in flight: loaded again (B's own prefix cache is
        # off), the same answers.
        run = b.closed_loop(world.prompts[1:3], concurrency=2, max_tokens=MAX_TOKENS)
        assert run["outputs"] == world.baseline[1:3]
        assert len(run["ttft_s"]) == 2 and all(0 < t <= run["elapsed_s"] for t in run["ttft_s"])

        # Two processes on one sidecar: what B stores, A loads.
        fresh = world.prompts[3]
        assert b.ask([fresh], MAX_TOKENS)["outputs"] == [world.baseline[3]]
        assert world.settled(BLOCKS_PER_PROMPT).get("blocks_written") == BLOCKS_PER_PROMPT
        before = world.stats().get("loads")
        assert world.a.ask([fresh], MAX_TOKENS)["outputs"] == [world.baseline[3]]
        assert world.stats().get("loads") == before + 1
        assert world.stats().get("blocks_written") == BLOCKS_PER_PROMPT
    finally:
        assert b.stop() == 0


def test_sidecar_stopped_vllm_still_answers_and_warns_once(world: World) -> None:
    assert not [line for line in world.a.log_lines if WARNING in line]
    world.sidecar.kill()
    assert world.a.ask([world.prompts[4]], MAX_TOKENS)["outputs"] == [world.baseline[4]]
    assert world.a.ask(world.prompts[:2], MAX_TOKENS)["outputs"] == world.baseline[:2]
    warnings = [line for line in world.a.log_lines if "kvsieve sidecar" in line and "failed" in line]
    assert len(warnings) == 1, warnings
    assert WARNING in warnings[0]
