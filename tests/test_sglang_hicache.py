"""kvsieve as SGLang's HiCache storage (engine_adapter/sglang, docs/sglang.md).

The SGLang part runs SGLang's own code in its environment (bash bench/sglang/setup_sglang.sh):
one subprocess (bench/sglang/hicache_driver.py scenarios) starts a real sidecar, lets
SGLang's factory load the backend by "dynamic", drives it with SGLang's host KV pools
and reports what it saw; the tests below judge each observation. Without that
environment they are skipped, unless KVSIEVE_REQUIRE_SGLANG=1 (.ci/run).

The rest runs here: the LookupMany RPC the backend's batch_exists uses, against a real
sidecar, and the page format's end-to-end check.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import require_sglang

from bench.common.sidecar import Sidecar
from engine_adapter.sglang.pages import TRAILER_BYTES, PageFormat, PageIdentity
from engine_adapter.sglang.settings import BackendSettings
from kvstore.client.kvclient import KVClient
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec

DRIVER = Path(__file__).resolve().parent.parent / "bench" / "sglang" / "hicache_driver.py"


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Any]:
    """Every scenario, run once by SGLang's code against real sidecars (and Redis, when there)."""
    python = require_sglang()
    work = tmp_path_factory.mktemp("sglang")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [str(python), str(DRIVER), "scenarios", "--kvsieve-python", sys.executable, "--work", str(work)]
    with contextlib.suppress(pytest.skip.Exception):  # no redis-server (fails under KVSIEVE_REQUIRE_REDIS=1)
        cmd += ["--redis-url", request.getfixturevalue("redis_url")]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    observed: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return observed


@pytest.mark.sglang
def test_sglang_factory_loads_the_backend_by_dynamic(seen: dict[str, Any]) -> None:
    assert seen["factory_class"] == "engine_adapter.sglang.backend.KvsieveStorage"
    assert seen["is_hicache_storage"] is True


@pytest.mark.sglang
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_128_pages_round_trip_byte_exact_into_either_layout(seen: dict[str, Any], layout: str) -> None:
    """Written from a layer-first pool by batch_set_v1, read by batch_get_v1 into `layout`."""
    assert seen["set_v1"] == [True] * 128
    got = seen[f"get_v1_{layout}"]
    assert got["flags"] == [True] * 128
    assert got["equal"] == [True] * 128
    assert got["untouched_before"] is True  # only the slots asked for were written


@pytest.mark.sglang
def test_generic_tensor_methods_round_trip_and_share_pages_with_v1(seen: dict[str, Any]) -> None:
    generic = seen["generic"]
    assert generic["batch_set"] is True and generic["set_one"] is True
    assert generic["found"] == [True] * 4
    assert generic["equal"] == [True] * 4  # a layer-first page read into a page-first pool
    assert generic["absent_is_none"] is True


@pytest.mark.sglang
def test_pool_group_methods_serve_kv_and_miss_other_pools(seen: dict[str, Any]) -> None:
    v2 = seen["v2"]
    assert (v2["exists_kv"], v2["exists_with_mamba"]) == (128, 0)
    assert v2["get_kv"] == [True] * 8 and v2["equal"] == [True] * 8
    assert v2["get_mamba"] == [False] * 8


@pytest.mark.sglang
def test_batch_exists_counts_leading_pages(seen: dict[str, Any]) -> None:
    assert seen["exists"] == {
        "all_128": 128,
        "gap_after_5": 5,
        "first_missing": 0,
        "empty": 0,
        "one": True,
        "absent": False,
    }


@pytest.mark.sglang
@pytest.mark.parametrize("differs_in", ["namespace", "tp_rank", "model"])
def test_another_deployment_reads_none_of_the_pages(seen: dict[str, Any], differs_in: str) -> None:
    assert seen["wrong_namespace"][differs_in] == {"exists": 0, "loaded": 0, "pool_untouched": True}


@pytest.mark.sglang
def test_a_page_filed_under_another_key_is_refused(seen: dict[str, Any]) -> None:
    forged = seen["forged"]
    assert forged["filed"] is True and forged["exists"] is True  # the sidecar holds it...
    assert forged["loaded"] == [False]  # ...but its trailer names another key: a miss
    assert forged["rejected"] == 1
    assert forged["pool_untouched"] is True


@pytest.mark.sglang
def test_a_byte_flipped_on_disk_makes_that_page_a_miss(seen: dict[str, Any]) -> None:
    corrupt = seen["corrupt"]
    assert corrupt["flipped_files"] == 1
    assert corrupt["loaded"] == [True, False, True]
    assert corrupt["neighbours_equal"] == [True, True]
    assert corrupt["victim_slot_untouched"] is True


@pytest.mark.sglang
def test_a_stopped_sidecar_is_misses_and_a_restarted_one_has_the_pages(seen: dict[str, Any]) -> None:
    stopped = seen["stopped"]
    assert stopped["exists"] == 0 and stopped["one_exists"] is False
    assert stopped["get_v1"] == [False] * 8  # a list, never None
    assert stopped["set_v1"] == [False] * 8
    assert stopped["get"] is None and stopped["set"] is False
    assert stopped["pool_untouched"] is True
    assert stopped["after_restart_exists"] == 128  # durable, and the backend reconnected
    assert stopped["after_restart_get_v1"] == 8
    assert stopped["after_restart_equal"] == [True] * 8


@pytest.mark.sglang
def test_fsck_and_relayout_leave_the_pages_intact(seen: dict[str, Any]) -> None:
    """Run on the stopped sidecar's directory; the pages load byte-exact afterwards (above)."""
    fsck, relayout = seen["stopped"]["offline"]["fsck"], seen["stopped"]["offline"]["relayout"]
    assert fsck["returncode"] == 0 and fsck["report"]["clean"] is True
    assert fsck["report"]["blocks_checked"] >= 128 and fsck["report"]["problems"] == []
    assert relayout["returncode"] == 0 and relayout["report"]["blocks_examined"] >= 128
    assert relayout["report"]["blocks_rewritten"] == 0  # no scores: pages stay in natural order


@pytest.mark.sglang
def test_a_hung_sidecar_is_misses_and_recovers(seen: dict[str, Any]) -> None:
    paused = seen["paused"]
    assert paused["exists"] == 0
    assert paused["get_v1"] == [False] * 8
    assert paused["after_resume_exists"] == 128


@pytest.mark.sglang
def test_mla_pages_are_shared_by_tp_ranks_across_layouts(seen: dict[str, Any]) -> None:
    mla = seen["mla"]
    assert mla["set_v1"] == [True] * 8
    assert mla["get_v1_rank1"] == [True] * 8
    assert mla["equal"] == [True] * 8


@pytest.mark.sglang
def test_pages_are_shared_through_redis_by_an_instance_on_another_sidecar(seen: dict[str, Any]) -> None:
    if "redis" not in seen:
        pytest.skip("redis-server not installed")
    shared = seen["redis"]
    assert shared["set_v1"] == [True] * 8
    assert shared["exists"] == 8
    assert shared["get_v1"] == [True] * 8
    assert shared["equal"] == [True] * 8


@pytest.mark.sglang
def test_a_host_pool_it_cannot_read_is_refused_by_name(seen: dict[str, Any]) -> None:
    assert "AsymmetricMHATokenToKVPoolHost" in seen["refused"]
    assert "split K/V widths" in seen["refused"]


@pytest.mark.sglang
def test_backup_metrics_and_clear(seen: dict[str, Any]) -> None:
    assert seen["stats"] == {"backup_pgs": [128], "clear": False}


# --- here, without SGLang ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    server = Sidecar(tmp_path_factory.mktemp("sidecar")).start()  # block_tokens 32
    yield server
    server.kill()


def test_lookup_many_counts_the_leading_lists_cached_whole(sidecar: Sidecar) -> None:
    model = ModelSpec("lookup-many", 2, 1, 8)
    lists = np.arange(5 * 32, dtype=np.uint32).reshape(5, 32) + 1000
    with KVClient(sidecar.address) as client:
        for row in (0, 1, 3):
            client.store(lists[row], np.ones(model.kv_shape(32), np.float16), model=model)
        assert client.lookup_many(lists, model=model) == 2  # row 2 is missing
        assert client.lookup_many(lists[[3, 0, 1]], model=model) == 3
        assert client.lookup_many(lists[[4, 0]], model=model) == 0
        assert client.lookup_many(lists[:2], model=model, namespace="other") == 0
        halves = lists[:2, :16].copy()  # a cached block's first half is not a whole list of 16...
        assert client.lookup_many(halves, model=model) == 0  # ...blocks are 32 tokens


@pytest.mark.parametrize("use_shm", [True, False])
def test_load_many_loads_each_list_whole_in_one_stream(sidecar: Sidecar, use_shm: bool) -> None:
    model = ModelSpec("load-many", 2, 1, 8)
    lists = np.arange(4 * 64, dtype=np.uint32).reshape(4, 64) + 5000
    kvs = [np.full(model.kv_shape(64), row + 1, np.float16) for row in range(4)]
    kvs[0][..., 40, :] = 7  # one token unlike its neighbours: positions must be kept
    with KVClient(sidecar.address, use_shm=use_shm) as client:
        for row in (0, 1, 3):
            client.store(lists[row], kvs[row], model=model)
        client.store(lists[2][:32], kvs[2][:, :, :, :32], model=model)  # only its first block
        seen, in_arena = [], []
        for row, delivered, kv in client.load_many(lists, model=model):
            seen.append((row, delivered, np.array(kv)))
            in_arena.append(isinstance(_memory_of(kv), mmap.mmap))
    assert [(row, delivered) for row, delivered, _ in seen] == [(0, 64), (1, 64), (2, 32), (3, 64)]
    assert in_arena == [use_shm] * 4  # shared memory when asked for, inline bytes otherwise
    for row, delivered, kv in seen:
        assert np.array_equal(kv, kvs[row][:, :, :, :delivered])


def _memory_of(array: np.ndarray[Any, Any]) -> object:
    """The object that owns an array's memory (an mmap for a view of an arena)."""
    base: object = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_lookup_many_refuses_lists_it_cannot_cut(sidecar: Sidecar) -> None:
    model = ModelSpec("lookup-many", 2, 1, 8)
    with KVClient(sidecar.address) as client, pytest.raises(InvalidInputError, match="token_lists"):
        client.lookup_many(np.arange(10, dtype=np.uint32), model=model)


def _format() -> PageFormat:
    identity = PageIdentity("m", "bfloat16", 16, 0, 1, 0, 1, False, "2x4x16x2x64")
    return PageFormat(identity, page_bytes=32768, tokens_per_page=256)


def test_page_trailer_checks_key_and_every_byte() -> None:
    fmt = _format()
    carrier = fmt.new_carrier()
    fmt.page_view(carrier)[:] = np.arange(fmt.page_bytes, dtype=np.uint64).astype(np.uint8)
    fmt.seal("page-a", carrier)
    assert fmt.check("page-a", carrier)
    assert not fmt.check("page-b", carrier)
    for at in (0, fmt.page_bytes - 1, fmt.carrier_bytes - TRAILER_BYTES + 20):
        damaged = carrier.copy()
        damaged.reshape(-1).view(np.uint8)[at] ^= 1
        assert not fmt.check("page-a", damaged)
    assert not fmt.check("page-a", carrier.reshape(-1)[:-1])  # short


def test_page_tokens_differ_per_key_and_identity_changes_the_spec() -> None:
    fmt = _format()
    tokens = fmt.tokens_of([f"k{i}" for i in range(64)])
    assert tokens.shape == (64, 256) and tokens.dtype == np.uint32
    assert len({row.tobytes() for row in tokens}) == 64
    assert np.array_equal(fmt.tokens("k5"), tokens[5])
    other = PageFormat(PageIdentity("m", "bfloat16", 16, 1, 2, 0, 1, False, "2x4x16x2x64"), 32768)
    assert other.spec.fingerprint != fmt.spec.fingerprint
    assert fmt.carrier_bytes >= fmt.page_bytes + TRAILER_BYTES


def test_settings_name_the_bad_key() -> None:
    settings = BackendSettings.from_extra_config(
        {"kvsieve_address": "10.0.0.1:9", "kvsieve_timeout_s": "2.5"}, env={}
    )
    assert (settings.address, settings.timeout_s, settings.shm) == ("10.0.0.1:9", 2.5, "auto")
    with pytest.raises(ValueError, match="kvsieve_timeout_s"):
        BackendSettings.from_extra_config({"kvsieve_timeout_s": "soon"}, env={})
    with pytest.raises(ValueError, match="kvsieve_tokens_per_page"):
        BackendSettings.from_extra_config({"kvsieve_tokens_per_page": 2}, env={})
    from_env = BackendSettings.from_extra_config({}, env={"KVSIEVE_SGLANG_TOKEN": "secret"})
    assert from_env.token == "secret"
