"""The engine's device path (`--device`), its staging pool, the cache keyword and the repetition guard.

CPU tests run the staged path (pooled buffers, layer-by-layer upload, download for
stores) on CPU tensors; the `gpu` tests need CUDA and are skipped without it.
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_adapter.runner.device import KVTransfer, resolve_device
from engine_adapter.runner.sampling import GENERATE_NO_REPEAT_NGRAM, Sampling
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.load.buffers import StagingError, StagingPool
from kvstore.load.device import DeviceCopier
from kvstore.store.tiered import TieredStore
from tests.conftest import RANDOM_WEIGHTS

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
#: A prompt of four whole 32-token blocks and a question after them.
CONTEXT = (
    "The lighthouse keeper wrote in his log every evening: the wind, the ships, the colour "
    "of the sea and the names of the birds that rested on the rail. "
) * 5
QUESTION = "What did the keeper write about?"


# -- device resolution ----------------------------------------------------------


def test_auto_picks_cuda_only_when_present() -> None:
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


#: A child process that sees no CUDA device, on any machine: the errors for machines without one
#: are checked on a GPU machine too (no test is skipped only because CUDA is there).
NO_CUDA = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_cuda_without_cuda_is_a_clear_error() -> None:
    code = (
        "from engine_adapter.runner.device import resolve_device\n"
        "from kvstore.errors import InvalidInputError\n"
        "try:\n    resolve_device('cuda')\nexcept InvalidInputError as exc:\n    print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=NO_CUDA
    )
    assert result.stdout.startswith("--device cuda: torch sees no CUDA device"), result.stdout + result.stderr


def test_generate_on_cuda_without_cuda_fails_before_loading_the_model() -> None:
    cmd = [sys.executable, "-m", "kvstore.cli.main", "generate", "hi", "--no-store", "--device", "cuda"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=NO_CUDA)
    assert result.returncode == 2
    assert "--device cuda: torch sees no CUDA device" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cpu:0", ""])
def test_unknown_device_names_the_choices(name: str) -> None:
    with pytest.raises(InvalidInputError, match="cpu, cuda, cuda:N, auto"):
        resolve_device(name)


# -- staging pool -----------------------------------------------------------------


def test_pool_allocates_nothing_after_warm_up() -> None:
    pool = StagingPool()
    sizes = [300_000, 70_000, 300_000, 1_000_000]
    for _ in range(2):  # warm-up: one buffer per size in flight at once
        buffers = [pool.take(n) for n in sizes]
        for b in buffers:
            pool.give(b)
    warm = pool.allocations
    for _ in range(5):
        buffers = [pool.take(n) for n in sizes]
        assert all(b.numel() >= n for b, n in zip(buffers, sizes, strict=True))
        for b in buffers:
            pool.give(b)
    assert pool.allocations == warm == len(sizes)


def test_pool_buffers_are_powers_of_two_and_best_fit() -> None:
    pool = StagingPool()
    small, big = pool.take(100_000), pool.take(600_000)
    assert (small.numel(), big.numel()) == (1 << 17, 1 << 20)
    pool.give(big)
    pool.give(small)
    assert pool.take(90_000).numel() == 1 << 17  # the small one, not the big one


def test_pool_over_its_limit_is_a_clear_error() -> None:
    pool = StagingPool(max_bytes=1 << 20)
    with pytest.raises(StagingError, match="does not fit the pool's limit of 1048576 bytes"):
        pool.take(2 << 20)
    held = pool.take(1 << 20)
    with pytest.raises(StagingError, match="limit"):
        pool.take(1 << 16)  # every byte is in use and nothing is in flight to wait for
    pool.give(held)
    assert pool.take(1 << 16).numel() >= 1 << 16  # a free buffer is dropped to make room


def test_copier_upload_reorders_and_converts_and_download_round_trips() -> None:
    copier = DeviceCopier("cpu")
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, 3, 10, 4)).astype(np.float16)
    order = rng.permutation(10)
    target = torch.empty(kv.shape, dtype=torch.float32)
    assert copier.upload(kv, target, order) is None  # done on return on CPU
    np.testing.assert_array_equal(target.numpy(), kv[:, :, order].astype(np.float32))
    back = copier.download(target.to(torch.float16)).result()
    np.testing.assert_array_equal(back, kv[:, :, order])
    assert copier.stream is None


def test_layer_upload_fills_the_cache_the_forward_reads() -> None:
    """A prefix uploaded layer by layer (shuffled, reordered on the way) gives the logits of the
    prefix's own cache: the hooks make each layer's copy land before its attention reads it."""
    from engine_adapter.runner.cache import cache_from, cache_kwargs, empty_cache
    from engine_adapter.runner.model import random_llama

    torch.manual_seed(0)
    model = random_llama((64, 128, 3, 4, 2, 100), "cpu", torch.float32)
    ids = torch.randint(0, 100, (1, 24))
    prefix_cache = empty_cache(model.config)
    with torch.inference_mode():
        model(input_ids=ids[:, :20], **cache_kwargs(model, prefix_cache))
        kv = torch.stack([torch.stack([x.keys[0], x.values[0]]) for x in prefix_cache.layers]).numpy()
        expected = model(input_ids=ids[:, 20:], **cache_kwargs(model, prefix_cache)).logits
        shuffle = np.random.default_rng(1).permutation(20)
        transfer = KVTransfer(torch.device("cpu"), staging=True)
        upload = transfer.upload(kv[:, :, :, shuffle], np.argsort(shuffle), torch.float32)
        cache = cache_from(model.config, upload.pairs)
        with upload.attached(model):
            got = model(
                input_ids=ids[:, 20:], position_ids=torch.arange(20, 24)[None], **cache_kwargs(model, cache)
            ).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


# -- the engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm() -> Any:
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TieredStore]:
    data = tmp_path_factory.mktemp("store") / "data"
    with TieredStore(StoreConfig(data_dir=data, block_tokens=32, chunk_tokens=8)) as s:
        yield s


def _prompt() -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{CONTEXT}\n\n{QUESTION}"}]


@pytest.mark.model
def test_cache_is_passed_by_the_name_the_forward_takes(lm: Any) -> None:
    from engine_adapter.runner.cache import cache_kwargs

    (name,) = set(cache_kwargs(lm.model, None)) - {"use_cache"}
    assert name in inspect.signature(type(lm.model).forward).parameters


@pytest.mark.model
def test_generate_raises_no_future_warning(lm: Any, store: TieredStore) -> None:
    from engine_adapter.runner.engine import Engine

    engine = Engine(lm, store)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers' deprecation of past_key_values
        first = engine.generate(_prompt(), Sampling(max_tokens=3))
        second = engine.generate(_prompt(), Sampling(max_tokens=3))  # the prefix loaded this time
        engine.generate_batch(["Hi", "Hello there"], Sampling(max_tokens=2))
    assert first.stored_blocks > 0 and second.loaded_tokens > 0


@pytest.fixture(scope="module")
def importance_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TieredStore]:
    """A store of the importance layout: its full loads are gathered, then staged (not packs)."""
    data = tmp_path_factory.mktemp("importance") / "data"
    with TieredStore(StoreConfig(data_dir=data, block_tokens=32, chunk_tokens=8, layout="importance")) as s:
        yield s


@pytest.mark.model
def test_staged_path_answers_as_the_plain_one_and_reuses_its_buffers(
    lm: Any, importance_store: TieredStore
) -> None:
    from engine_adapter.runner.engine import Engine

    store = importance_store
    sampling = Sampling(max_tokens=6)
    Engine(lm, store).generate(_prompt(), Sampling(max_tokens=1))  # the prefix is stored
    plain = Engine(lm, store).generate(_prompt(), sampling)
    transfer = KVTransfer(torch.device("cpu"), staging=True)
    staged = Engine(lm, store, transfer=transfer)
    first = staged.generate(_prompt(), sampling)
    warm = transfer.copier.pool.allocations
    again = staged.generate(_prompt(), sampling)
    assert plain.loaded_tokens > 0 and first.loaded_tokens == plain.loaded_tokens
    assert first.token_ids == again.token_ids == plain.token_ids
    pool = transfer.copier.pool  # the buffers made at the engine's start serve the copies too
    assert warm + pool.made_ahead > 0 and pool.allocations == warm  # nothing allocated after warm-up
    assert transfer.last_error == "" and transfer.last_counts is None  # not a load of packs


@pytest.mark.model
def test_a_full_load_of_packs_goes_to_the_device_with_no_staging(lm: Any, store: TieredStore) -> None:
    from engine_adapter.runner.engine import Engine

    sampling = Sampling(max_tokens=6)
    Engine(lm, store).generate(_prompt(), Sampling(max_tokens=1))  # the prefix is stored
    plain = Engine(lm, store).generate(_prompt(), sampling)
    transfer = KVTransfer(torch.device("cpu"), staging=True)
    staged = Engine(lm, store, transfer=transfer).generate(_prompt(), sampling)
    assert plain.loaded_tokens > 0 and staged.loaded_tokens == plain.loaded_tokens
    assert staged.token_ids == plain.token_ids and transfer.last_error == ""
    assert transfer.last_counts is not None and transfer.last_counts.staged_bytes == 0
    assert transfer.copier.pool.allocations == 0  # no staging buffer was ever needed


@pytest.mark.model
def test_a_failed_copy_recomputes_the_prompt(lm: Any, importance_store: TieredStore) -> None:
    from engine_adapter.runner.engine import Engine

    store = importance_store
    sampling = Sampling(max_tokens=6)
    reference = Engine(lm, None).generate(_prompt(), sampling)
    Engine(lm, store).generate(_prompt(), Sampling(max_tokens=1))  # the prefix is stored
    # A pool smaller than one layer's KV: the load's copy cannot be made.
    transfer = KVTransfer(torch.device("cpu"), staging=True, pool=StagingPool(max_bytes=1 << 16))
    engine = Engine(lm, store, transfer=transfer)
    result = engine.generate(_prompt(), sampling)
    assert "does not fit the pool's limit" in transfer.last_error
    assert result.loaded_tokens == 0 and result.computed_tokens == result.prompt_tokens
    assert result.token_ids == reference.token_ids


@pytest.mark.model
def test_a_device_copy_that_fails_mid_load_recomputes_the_prompt(
    lm: Any, store: TieredStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.upload import PackUpload

    sampling = Sampling(max_tokens=6)
    reference = Engine(lm, None).generate(_prompt(), sampling)
    Engine(lm, store).generate(_prompt(), Sampling(max_tokens=1))  # the prefix is stored
    calls = []

    def failing(self: PackUpload, first: int, end: int) -> None:  # what a CUDA error looks like
        calls.append(first)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(PackUpload, "_copy_group", failing)
    transfer = KVTransfer(torch.device("cpu"), staging=True)
    result = Engine(lm, store, transfer=transfer).generate(_prompt(), sampling)
    assert calls and "illegal memory access" in transfer.last_error
    assert result.loaded_tokens == 0 and result.token_ids == reference.token_ids


# -- the repetition guard --------------------------------------------------------------


def _ngrams(tokens: list[int], n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


@pytest.mark.model
def test_repetition_guard_stops_a_loop_and_is_off_when_disabled(lm: Any) -> None:
    from engine_adapter.runner.engine import Engine

    engine = Engine(lm, None)
    pattern = lm.tokenizer.encode(" red green blue yellow,")
    prompt = pattern * 6  # raw ids: greedy decoding continues the loop
    looping = engine.generate(prompt, Sampling(max_tokens=20))
    guarded = engine.generate(prompt, Sampling(max_tokens=20, no_repeat_ngram=4))
    grams = _ngrams(looping.token_ids, 4)
    assert len(set(grams)) < len(grams)  # off: the answer repeats itself
    grams = _ngrams(guarded.token_ids, 4)
    assert len(set(grams)) == len(grams)  # on: no 4-token run twice


def test_guard_is_on_in_generate_and_off_by_default_elsewhere() -> None:
    from engine_adapter.commands import _generate_flags

    parser = argparse.ArgumentParser()
    _generate_flags(parser)
    assert parser.parse_args(["hi"]).no_repeat_ngram == GENERATE_NO_REPEAT_NGRAM >= 2
    assert parser.parse_args(["hi", "--no-repeat-ngram", "0"]).no_repeat_ngram == 0
    assert Sampling().no_repeat_ngram == 0  # benchmarks and DSL programs: the plain model
    with pytest.raises(InvalidInputError, match="no_repeat_ngram"):
        Sampling(no_repeat_ngram=1)


def test_sampler_bans_the_token_that_would_repeat_a_run() -> None:
    from engine_adapter.runner.decode import Sampler

    sampler = Sampler(Sampling(no_repeat_ngram=3))
    vocab = 5

    def favour(token: int) -> torch.Tensor:
        logits = torch.zeros(1, vocab)
        logits[0, token] = 10.0
        logits[0, 4] = 5.0  # the runner-up
        return logits

    chosen = [int(sampler(favour(t))[0]) for t in (1, 2, 1, 2, 1, 2)]
    assert chosen[:4] == [1, 2, 1, 2]  # (1, 2, 1) and (2, 1, 2) are new runs
    assert chosen[4] == 4  # 1 after (1, 2) would repeat the run (1, 2, 1): the runner-up instead
    assert _ngrams(chosen, 3) == list(dict.fromkeys(_ngrams(chosen, 3)))


# -- on a GPU ----------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_gpu_greedy_answer_equals_the_cpus_with_the_prefix_loaded(
    lm: Any, store: TieredStore, tmp_path: Path
) -> None:
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.model import load_model

    sampling = Sampling(max_tokens=16)
    Engine(lm, store).generate(_prompt(), Sampling(max_tokens=1))  # the prefix is stored
    on_cpu = Engine(lm, store).generate(_prompt(), sampling)
    on_gpu_engine = Engine(load_model(quiet=True, device="cuda", dtype="float32"), store)
    on_gpu = on_gpu_engine.generate(_prompt(), sampling)
    assert on_cpu.loaded_tokens > 0 and on_gpu.loaded_tokens == on_cpu.loaded_tokens
    if not RANDOM_WEIGHTS:  # random weights' greedy answers may part at near-ties between devices
        assert on_gpu.token_ids == on_cpu.token_ids
    assert on_gpu_engine.transfer.staged and on_gpu_engine.transfer.last_error == ""
    counts = on_gpu_engine.transfer.last_counts  # a full load of packs from the pinned memory tier
    assert counts is not None and counts.staged_bytes == 0 and counts.device_copies > 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_half_precision_loads_the_prefix_and_stores_behind_the_answer(tmp_path: Path) -> None:
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.model import load_model

    config = StoreConfig(data_dir=tmp_path / "half", block_tokens=32, chunk_tokens=8)
    with TieredStore(config) as half_store:
        engine = Engine(load_model(quiet=True, device="cuda", dtype="bfloat16"), half_store)
        first = engine.generate(_prompt(), Sampling(max_tokens=4))
        assert engine.saver is not None and engine.flush_stores(timeout_s=120)
        assert first.stored_blocks > 0 and engine.saver.stats.blocks == first.stored_blocks
        second = engine.generate(_prompt(), Sampling(max_tokens=4))
        assert second.loaded_tokens > 0 and engine.transfer.last_error == ""
        assert engine.lm.spec.dtype == "bfloat16"


@pytest.mark.gpu
@needs_cuda
def test_gpu_staging_is_pinned_on_its_own_stream_and_pooled() -> None:
    copier = DeviceCopier("cuda")
    assert copier.stream is not None and copier.stream != torch.cuda.current_stream()
    kv = np.random.default_rng(0).standard_normal((2, 4, 512, 64)).astype(np.float16)
    target = torch.empty(kv.shape, dtype=torch.float32, device="cuda")
    for _ in range(3):
        torch.cuda.current_stream().wait_event(copier.upload(kv, target))
    warm = copier.pool.allocations
    for _ in range(10):
        torch.cuda.current_stream().wait_event(copier.upload(kv, target))
    buffer = copier.pool.take(kv.nbytes)
    assert buffer.is_pinned()
    copier.pool.give(buffer)
    assert copier.pool.allocations == warm
    np.testing.assert_array_equal(target.cpu().numpy(), kv.astype(np.float32))
