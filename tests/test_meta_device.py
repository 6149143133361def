"""The engine's paths on the CPU under a `meta` default device: what only a GPU showed, caught here.

A tensor made without naming its device lands on torch's default device. On a GPU machine that is
the CPU, beside a model on CUDA, and the first operation that mixes the two fails ("Expected all
tensors to be on the same device": `AttentionStats.observe` did that, issue 45). Here the model
and every tensor it makes live on the CPU while the default device is `meta`: a factory call
without `device=` makes a meta tensor, and mixing it with the model's CPU tensors, or reading it,
fails the same way. Each test runs one path of the engine that way and checks the path was taken.

The default device is per thread (torch keeps it in a thread-local): work that the engine runs on
threads of its own (the upload's feeder, the split's tail reader, the saver) makes its tensors
under the CPU default. tests/test_device_names.py covers those statically: every tensor factory
in the runner names its device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_adapter.runner import Engine, LoadedModel, Sampling
from engine_adapter.runner.costs import CostModel
from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.model import random_llama, spec_from_config
from engine_adapter.runner.topup import TopUpSettings
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

pytestmark = pytest.mark.model  # the real tokenizer (chat template, end-of-turn); the weights are random
#: Eight whole 32-token blocks and ten tokens after them; a question of eight more for the
#: layered path (it needs at least four new tokens to choose with).
PROMPT = np.random.default_rng(1).integers(0, 1000, 8 * 32 + 10).tolist()
QUESTION = [*PROMPT, 5, 6, 7, 8, 9, 10, 11, 12]


@contextlib.contextmanager
def meta_default() -> Iterator[None]:
    """Torch's default device is `meta` inside (on this thread), as it was before after."""
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(before)


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A two-layer random Llama on the CPU, computing with the engine's own attention (statistics
    on), with the default model's tokenizer (its vocabulary, chat template and end of turn)."""
    from engine_adapter.runner import load_model
    from engine_adapter.runner.attention import ATTENTION_NAME, register_attention

    tokenizer = load_model(quiet=True).tokenizer
    torch.manual_seed(0)
    model = random_llama((64, 128, 2, 4, 2, len(tokenizer)), "cpu", torch.float32)
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    source = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    return LoadedModel(model, tokenizer, spec_from_config(model.config, source, "float16"), source)


def _stored(lm: LoadedModel, config: StoreConfig) -> TieredStore:
    """A store holding PROMPT's eight blocks, made outside the meta default."""
    store = TieredStore(config)
    Engine(lm, store).prefill(PROMPT)
    return store


def test_the_meta_default_fails_a_tensor_made_without_its_device() -> None:
    """The harness itself: what it is there to catch does fail under it."""
    on_model = torch.ones(4)  # made on the CPU, as the model's tensors are
    with meta_default():
        assert torch.ones(4).device.type == "meta"
        assert torch.ones(4, device=on_model.device).device.type == "cpu"
        with pytest.raises((RuntimeError, NotImplementedError)):
            (on_model / torch.arange(4, 0, -1)).numpy()  # main's AttentionStats.observe, in one line


def test_prefill_with_statistics_and_analyze(lm: LoadedModel) -> None:
    engine = Engine(lm, None)  # collect_stats on: the default, and what failed on the GPU
    with meta_default():
        state = engine.prefill(PROMPT)
        kv, stats = engine.analyze(PROMPT[:64])
    assert state.logits.device.type == "cpu" and state.computed_tokens == len(PROMPT)
    assert kv.shape[3] == 64 and stats.prefill.shape == (64,) and np.isfinite(stats.prefill).all()


def test_a_full_load_from_the_store_and_the_answer(lm: LoadedModel, tmp_path: Path) -> None:
    with _stored(lm, StoreConfig(data_dir=tmp_path / "kv", block_tokens=32, chunk_tokens=8)) as store:
        engine = Engine(lm, store)
        with meta_default():
            result = engine.generate(PROMPT, Sampling(max_tokens=3))
        assert store.stats().get("score_reports") == 1  # the history statistics reached the store
    assert result.loaded_tokens == 256 and len(result.token_ids) >= 1


def test_a_staged_full_load_and_the_stores_behind_the_answer(lm: LoadedModel, tmp_path: Path) -> None:
    """The device path on the CPU: the load copied through the staging path, the new blocks
    copied off in pieces and stored by the saver."""
    config = StoreConfig(data_dir=tmp_path / "kv", block_tokens=32, chunk_tokens=8)
    with _stored(lm, config) as store, TieredStore(StoreConfig(data_dir=tmp_path / "new")) as empty:
        transfer = KVTransfer(torch.device("cpu"), staging=True)
        loading = Engine(lm, store, transfer=transfer)
        saving = Engine(lm, empty, transfer=KVTransfer(torch.device("cpu"), staging=True))
        with meta_default():
            loaded = loading.generate(PROMPT, Sampling(max_tokens=3))
            stored = saving.generate(PROMPT[:256] + PROMPT[:10], Sampling(max_tokens=2))
        assert saving.saver is not None and saving.flush_stores(timeout_s=60)
        assert saving.saver.stats.failed == 0 and saving.saver.stats.blocks == stored.stored_blocks == 1
    assert loaded.loaded_tokens == 256 and transfer.last_error == "" and transfer.last_counts is not None


def test_the_layered_load_and_the_top_up_while_decoding(lm: LoadedModel, tmp_path: Path) -> None:
    with _stored(lm, StoreConfig(data_dir=tmp_path / "kv", block_tokens=32, chunk_tokens=8)) as store:
        everything = TopUpSettings(theta=0.0, cap=1.0, within_budget=False)  # every step fetches
        engine = Engine(lm, store, topup=everything)
        with meta_default():
            engine.generate(QUESTION, Sampling(max_tokens=3), budget=0.5)
    report = engine.last_layered
    assert report is not None and report.error == "" and report.topup_error == ""
    assert report.matched_tokens == 256 and report.topup_chunks > 0


def test_the_split_computes_the_head_while_the_tail_loads(lm: LoadedModel, tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path / "kv", block_tokens=32, chunk_tokens=8, host_arena=True)
    _stored(lm, config).close()
    costs = CostModel()  # a disk far slower than the compute: load the tail, compute the head
    costs.observe_read("disk", 1_000_000, 1.0)
    for n in (1024, 2048, 4096):
        costs.observe_prefill(n, 0, n / 1000)
    with TieredStore(config) as store:  # memory empty: the prefix is on disk
        engine = Engine(lm, store, transfer=KVTransfer(torch.device("cpu"), staging=True), costs=costs)
        with meta_default():
            state = engine.prefill(PROMPT)
    plan = engine.last_split
    assert plan is not None and plan.kind == "split" and engine.transfer.last_error == ""
    assert 0 < state.loaded_tokens == plan.load_tokens < 256


def test_a_program_that_forks_decodes_its_branches_as_one_batch(lm: LoadedModel) -> None:
    from engine_adapter.dsl import plan
    from engine_adapter.dsl.run import ProgramRun

    source = """program p() {
      system "Be brief."
      user "Name a colour."
      a = fork { x = gen(max_tokens=3) return x }
      b = fork { y = gen(max_tokens=3) return y }
      c = fork { z = select(["Yes", "No"]) return z }
      wait a, b, c
      yield a, b, c
    }"""
    run = ProgramRun(Engine(lm, None), plan(source), {})
    with meta_default():
        events = list(run.events())
    assert events[-1].kind == "done", events[-1].value
    assert run.stats.max_batch == 2 and {e.name for e in events if e.kind == "yield"} == {"a", "b", "c"}


def test_a_batch_of_prompts(lm: LoadedModel) -> None:
    engine = Engine(lm, None)
    with meta_default():
        results = engine.generate_batch([PROMPT[:5], PROMPT[:9]], Sampling(max_tokens=2))
    assert len(results) == 2 and all(r.prompt_tokens in (5, 9) for r in results)
