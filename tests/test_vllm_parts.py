"""The vLLM connector's parts that need no vLLM: settings, the step planner, layout, the guard.

The layout tests build a cache in the CPU backend's exact layout and check the
round trip against a per-token reference written with plain loops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.common.sidecar import Sidecar
from engine_adapter.vllm import layout
from engine_adapter.vllm.guard import SidecarGuard
from engine_adapter.vllm.jobs import layer_order
from engine_adapter.vllm.plan import LoadOp, RequestTracker, SaveOp, ScheduledRequest
from engine_adapter.vllm.settings import ConnectorSettings
from engine_adapter.vllm.worker import WorkerSide
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec

# -- settings ----------------------------------------------------------------------


def test_settings_from_extra_config() -> None:
    s = ConnectorSettings.from_extra_config({"store": "127.0.0.1:7000", "namespace": "t1", "mode": "load"})
    assert (s.store, s.namespace, s.loads, s.saves) == ("127.0.0.1:7000", "t1", True, False)
    assert ConnectorSettings.from_extra_config(None) == ConnectorSettings()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"mode": "sometimes"}, "mode"),
        ({"store": "nohostport"}, "store"),
        ({"namespace": ""}, "namespace"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"block_tokens": 0}, "block_tokens"),
        ({"save_queue_bytes": 0}, "save_queue_bytes"),
        ({"save_queue_bytes": 1.5}, "save_queue_bytes"),
        ({"adress": "x:1"}, "adress"),
        ({"timings_path": ""}, "timings_path"),
        ({"timings_path": 3}, "timings_path"),
    ],
)
def test_settings_refuse_bad_values_naming_the_field(extra: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        ConnectorSettings.from_extra_config(extra)


# -- planner -----------------------------------------------------------------------


def _tracker(loads: bool = True, saves: bool = True) -> RequestTracker:
    return RequestTracker(vllm_block_size=32, kvsieve_block_tokens=256, loads=loads, saves=saves)


def test_hit_is_cut_to_vllm_blocks_and_load_planned_after_alloc() -> None:
    t = _tracker()
    prompt = list(range(1000))
    t.on_lookup("r", prompt, 768)
    assert t.loadable_tokens("r", 0) == 768
    assert t.loadable_tokens("r", 64) == 704  # vLLM's own cache holds the first two blocks
    t.on_alloc("r", 704)
    blocks = tuple(range(100, 132))
    plan = t.plan([ScheduledRequest("r", 768, 232, blocks, replace=True)])
    assert plan.loads == (LoadOp("r", tuple(prompt[:768]), 64, 768, blocks[:24]),)
    # The prompt is done this step: its 3 whole kvsieve blocks minus the 3 held -> nothing to save.
    assert plan.saves == ()


def test_hit_not_on_a_vllm_block_boundary_is_rounded_down() -> None:
    t = RequestTracker(vllm_block_size=96, kvsieve_block_tokens=256, loads=True, saves=True)
    t.on_lookup("r", list(range(600)), 512)
    assert t.loadable_tokens("r", 0) == 480


def test_save_after_chunked_prefill_with_growing_block_table() -> None:
    t = _tracker()
    prompt = list(range(600))
    t.on_lookup("r", prompt, 0)
    first = t.plan([ScheduledRequest("r", 0, 320, tuple(range(10)), replace=True)])
    assert first.saves == ()  # prompt not finished: nothing stored yet
    second = t.plan([ScheduledRequest("r", 320, 280, tuple(range(10, 19)), replace=False)])
    assert second.saves == (SaveOp("r", tuple(prompt[:512]), 0, tuple(range(16))),)
    third = t.plan([ScheduledRequest("r", 600, 1, (), replace=False)])
    assert third.saves == ()  # saved once


def test_save_sends_only_blocks_the_sidecar_lacks() -> None:
    t = _tracker()
    prompt = list(range(800))
    t.on_lookup("r", prompt, 256)
    plan = t.plan([ScheduledRequest("r", 256, 544, tuple(range(25)), replace=True)])
    assert plan.saves == (SaveOp("r", tuple(prompt[:768]), 256, tuple(range(24))),)


def test_no_save_when_lookup_failed_and_no_load_in_save_mode() -> None:
    down = _tracker()
    down.on_lookup("r", list(range(600)), None)
    assert down.loadable_tokens("r", 0) == 0
    assert down.plan([ScheduledRequest("r", 0, 600, tuple(range(19)), replace=True)]).saves == ()
    save_only = _tracker(loads=False)
    save_only.on_lookup("r", list(range(600)), 512)
    assert save_only.loadable_tokens("r", 0) == 0


def test_forget_drops_state() -> None:
    t = _tracker()
    t.on_lookup("r", list(range(600)), 512)
    t.on_alloc("r", 512)
    t.forget("r")
    assert not t.known("r")
    assert t.plan([ScheduledRequest("r", 0, 600, (1, 2), replace=True)]).loads == ()


# -- layout ------------------------------------------------------------------------

SPEC = ModelSpec("tiny", num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16")
BLOCK = 8
CPU = layout.cpu_layout(SPEC.head_dim)


def _cache(num_blocks: int = 12, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, SPEC.num_kv_heads, BLOCK, 2 * SPEC.head_dim)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(SPEC.num_layers)]


def _reference_token(layer: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    """(2, heads, dim) of one token, read the way the CPU kernel reads a tile: K rows, then V rows."""
    tile = layer[block].reshape(SPEC.num_kv_heads, 2 * BLOCK, SPEC.head_dim)
    return torch.stack([tile[:, offset], tile[:, BLOCK + offset]])


def test_gather_matches_the_kernels_tile_layout() -> None:
    layers = _cache()
    table = [7, 2, 9]
    positions = np.array([0, 5, 8, 15, 16, 23])
    kv = layout.gather(layers, layout.slots_of(positions, table, BLOCK), CPU)
    assert kv.shape == SPEC.kv_shape(len(positions))
    for i, p in enumerate(positions):
        for li, layer in enumerate(layers):
            assert torch.equal(kv[li, :, :, i], _reference_token(layer, table[p // BLOCK], p % BLOCK))


def test_scatter_round_trip_in_any_token_order_touches_nothing_else() -> None:
    source, target = _cache(seed=1), _cache(seed=2)
    before = [t.clone() for t in target]
    src_table, dst_table = [0, 1, 2], [5, 3, 11]
    positions = np.random.default_rng(0).permutation(np.arange(4, 20))  # importance order, say
    kv = layout.gather(source, layout.slots_of(positions, src_table, BLOCK), CPU)
    layout.scatter(target, kv, layout.slots_of(positions, dst_table, BLOCK), CPU)
    back = layout.gather(target, layout.slots_of(positions, dst_table, BLOCK), CPU)
    assert torch.equal(back, kv)
    written = {(dst_table[p // BLOCK], p % BLOCK) for p in positions}
    for layer, old in zip(target, before, strict=True):
        for block in range(layer.shape[0]):
            for offset in range(BLOCK):
                if (block, offset) not in written:
                    assert torch.equal(
                        _reference_token(layer, block, offset), _reference_token(old, block, offset)
                    )


def test_copied_blocks_give_the_gathered_kv_of_any_token_range() -> None:
    layers = _cache(seed=7)
    table = [7, 2, 9, 4]
    positions = np.arange(5, 29)  # starts and ends inside a block
    want = layout.gather(layers, layout.slots_of(positions, table, BLOCK), CPU)
    blocks = layout.copy_blocks(layers, table, CPU)
    assert blocks.shape == (SPEC.num_layers, 4, SPEC.num_kv_heads, BLOCK, 2 * SPEC.head_dim)
    assert not any(np.shares_memory(layout.to_numpy(blocks), layout.to_numpy(t)) for t in layers)
    got = layout.blocks_to_kv(blocks, CPU, 5, 24)
    assert got.shape == SPEC.kv_shape(24) and got.dtype == SPEC.np_dtype
    assert np.array_equal(got.view(np.uint16), layout.to_numpy(want).view(np.uint16))
    with pytest.raises(InvalidInputError, match="copied blocks"):
        layout.blocks_to_kv(blocks, CPU, 5, 28)


def test_numpy_bfloat16_round_trip_shares_memory() -> None:
    kv = layout.gather(_cache(), layout.slots_of(np.arange(8), [1], BLOCK), CPU)
    arr = layout.to_numpy(kv)
    assert arr.dtype == SPEC.np_dtype and arr.shape == SPEC.kv_shape(8)
    back = layout.from_numpy(arr)
    assert torch.equal(back, kv)
    assert np.shares_memory(layout.to_numpy(back), arr)


def test_layout_refuses_wrong_shapes_and_dtypes() -> None:
    with pytest.raises(InvalidInputError, match=r"CPU_ATTN.*head_dim 4"):
        CPU.token_view(torch.zeros(2, 2, 8, 6))
    with pytest.raises(InvalidInputError, match="past the request"):
        layout.slots_of([16], [0, 1], BLOCK)
    with pytest.raises(InvalidInputError, match="dtype"):
        layout.dtype_name(torch.float8_e4m3fn)


def test_layer_order_is_numeric() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]
    assert layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]


# -- guard -------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_guard_warns_once_per_outage_and_skips_until_retry(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    guard = SidecarGuard(retry_after_s=30, clock=clock, log=logging.getLogger("test.guard"))
    calls: list[int] = []

    def down() -> int:
        calls.append(1)
        raise ConnectionError("sidecar gone")

    with caplog.at_level(logging.INFO, logger="test.guard"):
        assert guard.call("lookup", down) is None
        assert guard.call("lookup", down) is None  # skipped: breaker open
        clock.now = 31
        assert guard.call("load", down) is None  # tried again, still down: no second warning
        clock.now = 62
        assert guard.call("lookup", lambda: 7) == 7
    assert len(calls) == 2 and guard.skipped == 1 and guard.failures == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sidecar gone" in warnings[0].getMessage()
    assert any("answers again" in r.getMessage() for r in caplog.records)


# -- worker side against a real embedded store (no vLLM) ------------------------------


def _worker(
    store: object, layers: list[torch.Tensor], namespace: str = "default", queue_bytes: int = 1 << 20
) -> WorkerSide:
    # TieredStore and KVClient share method names and signatures: the worker takes either.
    worker = WorkerSide(store, SPEC, namespace, BLOCK, SidecarGuard(30), save_queue_bytes=queue_bytes)
    worker.register({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)})
    return worker


def _sent(worker: WorkerSide) -> int:
    """Wait for the worker's saves to be sent, stop its sender; the new blocks stored."""
    assert worker.flush(30)
    assert worker.close(5) and not worker.saves.running
    return worker.saved_blocks


def test_worker_saves_then_loads_into_other_blocks(tmp_path: Path) -> None:
    from kvstore.config import StoreConfig
    from kvstore.store.tiered import TieredStore

    config = StoreConfig(data_dir=tmp_path / "d", block_tokens=16, chunk_tokens=8, memory_bytes=1 << 20)
    tokens = tuple(range(1, 41))
    with TieredStore(config) as store:
        source = _worker(store, _cache(seed=3))
        assert source.save((SaveOp("a", tokens[:32], 0, (4, 6, 1, 0)),)) == 1
        assert _sent(source) == 2
        target = _worker(store, _cache(seed=4))
        outcome = target.start_load((LoadOp("b", tokens[:32], 8, 32, (9, 8, 7, 10)),))
        assert outcome[0].written_tokens == 24 and not outcome[0].failed_blocks
        got = layout.gather(target.layers, layout.slots_of(np.arange(8, 32), (9, 8, 7, 10), BLOCK), CPU)
        want = layout.gather(source.layers, layout.slots_of(np.arange(8, 32), (4, 6, 1, 0), BLOCK), CPU)
        assert torch.equal(got, want)
        assert target.take_failed_blocks() == set()
        assert target.close(5)


def test_worker_reports_every_block_of_a_failed_load(caplog: pytest.LogCaptureFixture) -> None:
    from bench.common.sidecar import free_port
    from kvstore.client.kvclient import KVClient

    client = KVClient(f"127.0.0.1:{free_port()}", timeout_s=2)  # nothing listens there
    worker = _worker(client, _cache())
    before = [t.clone() for t in worker.layers]
    with caplog.at_level(logging.WARNING):
        worker.start_load((LoadOp("b", tuple(range(32)), 8, 32, (9, 8, 7, 10)),))
    assert worker.take_failed_blocks() == {8, 7, 10}  # block 9 held vLLM's own tokens 0..7
    assert all(torch.equal(a, b) for a, b in zip(worker.layers, before, strict=True))
    assert worker.take_failed_blocks() == set()
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1
    client.close()


def test_short_load_fails_the_rest_warns_and_skips_the_steps_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvstore.config import StoreConfig
    from kvstore.store.tiered import TieredStore

    config = StoreConfig(data_dir=tmp_path / "d", block_tokens=16, chunk_tokens=8, memory_bytes=1 << 20)
    tokens = tuple(range(1, 65))
    with TieredStore(config) as store:
        first = _worker(store, _cache(seed=5))
        assert first.save((SaveOp("a", tokens[:16], 0, (0, 1)),)) == 1
        assert _sent(first) == 1
        worker = _worker(store, _cache(seed=6))
        # The scheduler was promised 48 tokens; only the first block is there (evicted since, say).
        with caplog.at_level(logging.WARNING):
            outcome = worker.start_load((LoadOp("b", tokens[:48], 0, 48, (3, 4, 5, 6, 7, 8)),))
        assert outcome[0].written_tokens == 16
        assert worker.take_failed_blocks() == {5, 6, 7, 8}
        assert any("delivered 16 of 48" in r.getMessage() for r in caplog.records)
        # In that step, KV computed after the hole is wrong: nothing may be stored.
        assert worker.save((SaveOp("b", tokens[:64], 16, (3, 4, 5, 6, 7, 8, 9, 10)),)) == 0
        assert worker.flush(30) and worker.saves.stats().sent == 0
        assert store.lookup(tokens, model=SPEC).num_tokens == 16
        # The next step stores again.
        worker.start_load(())
        assert worker.save((SaveOp("b", tokens[:64], 16, (3, 4, 5, 6, 7, 8, 9, 10)),)) == 1
        assert _sent(worker) == 3


# -- saves off the critical path, against a real sidecar ------------------------------

SAVE_TOKENS = 32  # one block of the conftest sidecar (--block-tokens 32), four vLLM blocks of BLOCK


@contextlib.contextmanager
def _stopped(sidecar: Sidecar) -> Iterator[None]:
    """The sidecar process frozen (SIGSTOP): connections stay open, nothing answers."""
    assert sidecar.proc is not None
    os.kill(sidecar.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)


def _prompt(i: int) -> tuple[int, ...]:
    return tuple(range(1000 * i + 1, 1000 * i + 1 + SAVE_TOKENS))


def test_full_save_queue_drops_and_counts_without_blocking(sidecar: Sidecar) -> None:
    from kvstore.client.kvclient import KVClient

    save_bytes = 4 * SPEC.num_layers * _cache()[0][0].nbytes  # four vLLM blocks of every layer
    with KVClient(sidecar.address, timeout_s=30) as client:
        client.stats()  # connected before the freeze
        worker = _worker(client, _cache(seed=8), "save-full", queue_bytes=3 * save_bytes)
        took = []
        with _stopped(sidecar):
            for i in range(8):
                t0 = time.perf_counter()
                worker.save((SaveOp(f"r{i}", _prompt(i), 0, (4, 6, 1, 0)),))
                took.append(time.perf_counter() - t0)
            stats = worker.saves.stats()
            # Three fit (the one being sent to the frozen sidecar included), five were dropped.
            assert (stats.dropped, stats.sent, stats.queued_bytes) == (5, 0, 3 * save_bytes)
        assert max(took) < 0.5, took
        assert _sent(worker) == 3
        assert worker.saves.stats() == (0, 0, 3, 5)
        found = [client.lookup(_prompt(i), model=SPEC, namespace="save-full").num_tokens for i in range(8)]
        assert found == [SAVE_TOKENS] * 3 + [0] * 5
        # Closed: a later save is dropped and counted, no thread starts again.
        assert worker.save((SaveOp("late", _prompt(9), 0, (4, 6, 1, 0)),)) == 0
        assert worker.saves.stats().dropped == 6 and not worker.saves.running


def test_saved_bytes_are_those_of_the_copy_not_of_the_reused_blocks(sidecar: Sidecar) -> None:
    from kvstore.client.kvclient import KVClient

    table = (4, 6, 1, 0)
    with KVClient(sidecar.address, timeout_s=30) as client:
        client.stats()
        source = _worker(client, _cache(seed=9), "save-copy")
        at_save = [t.clone() for t in source.layers]
        with _stopped(sidecar):  # the send cannot happen before vLLM reuses the blocks
            assert source.save((SaveOp("r", _prompt(0), 0, table),)) == 1
            for layer, other in zip(source.layers, _cache(seed=10), strict=True):
                layer.copy_(other)  # vLLM frees the blocks and writes another request there
            assert source.saves.stats().queued_bytes > 0  # not sent yet
        assert _sent(source) == 1
        target = _worker(client, _cache(seed=11), "save-copy")
        assert (
            target.start_load((LoadOp("b", _prompt(0), 0, SAVE_TOKENS, (9, 8, 7, 10)),))[0].written_tokens
            == 32
        )
        positions = np.arange(SAVE_TOKENS)
        got = layout.gather(target.layers, layout.slots_of(positions, (9, 8, 7, 10), BLOCK), CPU)
        want = layout.gather(at_save, layout.slots_of(positions, table, BLOCK), CPU)
        reused = layout.gather(source.layers, layout.slots_of(positions, table, BLOCK), CPU)
        assert torch.equal(got, want) and not torch.equal(got, reused)
        assert target.close(5)


def test_shutdown_with_a_frozen_sidecar_stops_the_sender_in_bounded_time(
    sidecar: Sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    from kvstore.client.kvclient import KVClient

    with KVClient(sidecar.address, timeout_s=2) as client:
        client.stats()
        worker = _worker(client, _cache(seed=12), "save-close")
        with _stopped(sidecar), caplog.at_level(logging.INFO):
            assert worker.save(tuple(SaveOp(f"r{i}", _prompt(i), 0, (4, 6, 1, 0)) for i in range(3))) == 3
            t0 = time.perf_counter()
            stopped = worker.close(1)  # drain for 1 s; the send in flight ends by its 2 s deadline
            elapsed = time.perf_counter() - t0
        assert stopped and not worker.saves.running
        assert 1 <= elapsed < 4, elapsed
        stats = worker.saves.stats()
        assert stats.sent + stats.dropped == 3 and stats.queued_bytes == 0 and worker.saved_blocks == 0
        assert any("kvsieve saves: " in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("line", "rest"),
    [
        ('KVSIEVE_DRIVER {"elapsed_s": 0.5}\n', "\n"),
        # Another process's log line landed between the reply and its newline (seen in a bench run).
        ('KVSIEVE_DRIVER {"elapsed_s": 0.5}(Worker pid=7) WARNING x\n', "(Worker pid=7) WARNING x\n"),
        # ... or before it, on the same line.
        ('(Worker pid=7) WARN KVSIEVE_DRIVER {"elapsed_s": 0.5}\n', "(Worker pid=7) WARN \n"),
    ],
)
def test_driver_replies_survive_log_lines_of_other_processes(line: str, rest: str) -> None:
    from engine_adapter.vllm.driver import _split_reply

    assert _split_reply(line) == ({"elapsed_s": 0.5}, rest)


def test_driver_lines_without_a_reply_are_log_text() -> None:
    from engine_adapter.vllm.driver import _split_reply

    assert _split_reply("INFO starting\n") == (None, "INFO starting\n")


# -- benchmark answers ------------------------------------------------------------------


def test_bench_counts_first_tokens_that_differ_from_recompute() -> None:
    from bench.vllm.vllm_bench import Answer, first_token_mismatches

    recompute = [Answer(1.0, 11), Answer(1.1, 12), Answer(0.9, 13)]
    assert first_token_mismatches(recompute, [Answer(0.2, 11), Answer(0.3, 12), Answer(0.2, 13)]) == 0
    assert first_token_mismatches(recompute, [Answer(0.2, 11), Answer(0.3, 99), Answer(0.2, 7)]) == 2
    with pytest.raises(ValueError, match="2 answers for 3 documents"):
        first_token_mismatches(recompute, recompute[:2])


def test_bench_zeroes_the_example_connectors_files_in_place(tmp_path: Path) -> None:
    import safetensors.torch

    from bench.vllm.vllm_bench import zero_safetensors

    layer = tmp_path / "abc" / "model.layers.0.self_attn.attn.safetensors"
    layer.parent.mkdir()
    kv = torch.arange(1, 25, dtype=torch.bfloat16).reshape(2, 3, 4)
    safetensors.torch.save_file({"kv_cache": kv}, layer)
    (tmp_path / "other.txt").write_text("not a tensor file")
    assert zero_safetensors(tmp_path) == 1
    back = safetensors.torch.load_file(layer)["kv_cache"]
    assert back.dtype == kv.dtype and back.shape == kv.shape and not back.any()


def test_bench_breakdown_subtracts_the_parts_on_the_request_path_only() -> None:
    from bench.vllm.vllm_bench import Answer, breakdown

    answers = [
        Answer(1.0, 1, {"lookup": 0.01, "fetch": 0.2, "copy": 0.1, "store": 5.0}),
        Answer(2.0, 1, {"lookup": 0.03, "fetch": 0.4, "copy": 0.3, "store": 7.0}),
        Answer(1.5, 1, {"lookup": 0.02, "fetch": 0.3}),  # no copy record: counted as 0
    ]
    out = breakdown("hit", answers, ("lookup", "fetch", "copy"), background=("store",))
    assert out["hit_lookup_s"] == 0.02 and out["hit_fetch_s"] == 0.3 and out["hit_copy_s"] == 0.1
    assert out["hit_store_s"] == 5.0
    # The rest per answer: 0.69, 1.27, 1.18 -> median 1.18 (the background send is not subtracted).
    assert out["hit_vllm_s"] == pytest.approx(1.18)


def test_timing_log_lines_from_two_writers_are_read_in_order_from_an_offset(tmp_path: Path) -> None:
    from engine_adapter.vllm.timings import TimingLog, read_records

    path = tmp_path / "timings.jsonl"
    scheduler, worker = TimingLog(str(path)), TimingLog(str(path))  # two processes' logs on one file
    with scheduler.span("lookup", tokens=10) as record:
        record["hit_tokens"] = 8
    worker.record("load", fetch_s=0.5, copy_s=0.25, tokens=8)
    first, offset = read_records(path)
    assert [(r["what"], r.get("hit_tokens"), r.get("tokens")) for r in first] == [
        ("lookup", 8, 10),
        ("load", None, 8),
    ]
    assert first[0]["s"] >= 0 and first[1]["fetch_s"] == 0.5
    with path.open("ab") as f:
        f.write(b'{"what": "store", "s": 1')  # a line still being written is not read yet
    assert read_records(path, offset) == ([], offset)
    with path.open("ab") as f:
        f.write(b".5}\n")
    assert read_records(path, offset)[0] == [{"what": "store", "s": 1.5}]
    off = TimingLog(None)
    off.record("load", fetch_s=1.0)  # disabled: nothing written anywhere
    assert not off.enabled
    scheduler.close()
    worker.close()


def test_load_stream_asks_every_document_once_per_round() -> None:
    from bench.vllm.concurrency import QUESTIONS, stream

    class Words:  # a tokenizer of this test's own: one id per character
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    prompts = stream(Words(), documents=4, requests=10, doc_tokens=64)
    docs = [tuple(p[:64]) for p in prompts]
    assert len(prompts) == 10 and len(set(docs)) == 4
    assert all(len(set(docs[r : r + 4])) == 4 for r in (0, 4))  # two whole rounds, then two more
    asked: dict[tuple[int, ...], int] = {}
    for doc, prompt in zip(docs, prompts, strict=True):
        question = [ord(c) for c in QUESTIONS[asked.get(doc, 0) % len(QUESTIONS)]]
        assert prompt[64:] == question  # each document's questions in turn
        asked[doc] = asked.get(doc, 0) + 1


def test_load_summary_ratios_come_from_each_modes_run() -> None:
    from bench.vllm.concurrency import MODES, summarize

    prompts = [[1] * 100, [2] * 100]
    runs = {
        mode: {
            "outputs": [[7, 1], [8, 2]],
            "ttft_s": [0.1 * (i + 1), 0.2 * (i + 1)],
            "elapsed_s": 2.0 * (i + 1),
        }
        for i, mode in enumerate(MODES)
    }
    runs["kvsieve"]["outputs"] = [[7, 1], [9, 2]]  # one first token differs from plain's
    out = summarize(runs, prompts, concurrency=2)
    assert out["throughput_rps_plain"] == 1.0 and out["prompt_tokens_per_s_plain"] == 100.0
    assert out["throughput_kvsieve_vs_plain"] == round(1 / 3, 3)
    assert out["ttft_p99_s_prefix_cache"] == pytest.approx(0.398, abs=1e-3)
    assert out["p99_ttft_kvsieve_vs_prefix_cache"] == pytest.approx(1.5, abs=1e-3)
    assert out["load_first_token_mismatches_by_mode"] == {m: int(m == "kvsieve") for m in MODES}
