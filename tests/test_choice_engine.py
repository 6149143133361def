"""The engine's side of the learned choice: what each request files in the cost model, that it then
runs what was measured fastest, what a warm request pays for choosing, and the disk probed off the
request path. On the CPU with the staged (device) path, a random Llama of a small shape, a real
store, and an injected clock: each plan "takes" what the test says."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine_adapter.runner import disk_probe
from engine_adapter.runner.choice import EXPLORE_REQUESTS
from engine_adapter.runner.costs import CostModel
from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.engine import Engine
from engine_adapter.runner.model import LoadedModel, random_llama, spec_from_config
from engine_adapter.runner.plans import FULL, RECOMPUTE, Option, Request
from kvstore.config import StoreConfig, store_data_file
from kvstore.store.tiered import TieredStore

BLOCK = 32
PREFIX = 8 * BLOCK


class PlanClock:
    """The engine's clock: each prefill takes `seconds[kind]` of the plan the engine ran, 100 s if not
    given (a prompt with nothing cached runs no plan: it is computed, "recompute"). Seconds, not
    milliseconds: the engine files them less the store's part in line, which is real time."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.now, self.engine, self._calls = seconds, 0.0, None, 0

    def __call__(self) -> float:
        self._calls += 1
        if self._calls % 2 == 0:  # the end of a prefill
            assert self.engine is not None
            plan = self.engine.last_split
            self.now += self.seconds.get(plan.kind if plan is not None else RECOMPUTE, 100.0)
        return self.now


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.manual_seed(0)
    model = random_llama((128, 256, 4, 4, 2, 1000), "cpu", torch.float32)
    source = tmp_path_factory.mktemp("tiny")
    return LoadedModel(model, None, spec_from_config(model.config, source, "float16"), source)


@pytest.fixture
def config(tmp_path: Path) -> StoreConfig:
    return StoreConfig(data_dir=tmp_path / "kv", block_tokens=BLOCK, chunk_tokens=8, host_arena=True)


def _ids(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, PREFIX + 10).tolist()


def _engine(lm: LoadedModel, store: Any, clock: PlanClock | None = None, **kwargs: Any) -> Engine:
    """An engine on the staged path (where it chooses), its clock the test's (if given)."""
    if clock is not None:
        kwargs["clock"] = clock
    transfer = KVTransfer(torch.device("cpu"), staging=True)
    engine = Engine(lm, store, collect_stats=False, topup=None, transfer=transfer, **kwargs)
    if clock is not None:
        clock.engine = engine
    return engine


@pytest.mark.parametrize("fast", [RECOMPUTE, FULL])
def test_the_engine_runs_what_it_measured_fastest(lm: LoadedModel, config: StoreConfig, fast: str) -> None:
    slow = FULL if fast == RECOMPUTE else RECOMPUTE
    clock = PlanClock({fast: 1.0, slow: 5.0})
    ids = _ids(1)
    with TieredStore(config) as store:
        engine = _engine(lm, store, clock)
        engine.prefill(ids)  # a miss: computed whole, filed as recompute at this prompt's length
        engine.flush_stores()
        counts: dict[str, int] = {}
        _counting(store, counts, ("store",))
        kinds, loaded = [], []
        for _ in range(EXPLORE_REQUESTS + 4):
            state = engine.prefill(ids)
            assert engine.last_split is not None
            kinds.append(engine.last_split.kind)
            loaded.append(state.loaded_tokens)
        assert engine.flush_stores(30)
    request = Request(len(ids), PREFIX, 1.0, lm.spec.token_bytes, BLOCK)
    recompute_s = engine.costs.measured_s(Option(RECOMPUTE), request)
    # what the clock said, less the store's part in line (real seconds: a few ms here)
    assert recompute_s == pytest.approx(1.0 if fast == RECOMPUTE else 5.0, abs=0.2)
    assert recompute_s <= (1.0 if fast == RECOMPUTE else 5.0)
    assert counts.get("store", 0) == 0  # a chosen recompute stores nothing the store holds already
    # Each other kind tried at most once (its estimate said it might win): measured slower, never again.
    assert all(kinds.count(kind) <= 1 for kind in set(kinds) - {fast}), kinds
    assert kinds[-4:] == [fast] * 4, kinds
    assert loaded[-1] == (0 if fast == RECOMPUTE else PREFIX)
    assert engine.last_split.measured and "measured" in engine.last_split.reason


def _store(lm: LoadedModel, store: TieredStore, ids: list[int]) -> None:
    """Compute `ids` and store its blocks (the saver's queue drained)."""
    engine = _engine(lm, store)
    engine.prefill(ids)
    assert engine.flush_stores(30)


def _counting(
    store: TieredStore, counts: dict[str, int], names: tuple[str, ...] = ("lookup", "load", "open_layers")
) -> None:
    """Count the store calls the engine makes (on the instance: it stays a TieredStore)."""
    for name in names:
        method = getattr(store, name)

        def counted(*args: Any, _method: Callable[..., Any] = method, _name: str = name, **kw: Any) -> Any:
            counts[_name] = counts.get(_name, 0) + 1
            return _method(*args, **kw)

        setattr(store, name, counted)


def test_a_warm_request_pays_one_lookup_for_the_choice_and_runs_the_plain_full_load(
    lm: LoadedModel, config: StoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _ids(2)
    costs = CostModel()
    with TieredStore(config) as store:
        _store(lm, store, ids)
        plain = _engine(lm, store, split=False, costs=costs)  # told to load: files "full"
        expected = plain.prefill(ids)
        choosing = _engine(lm, store, costs=costs, clock=PlanClock({FULL: 1.0, RECOMPUTE: 5.0}))
        for _ in range(EXPLORE_REQUESTS):  # past the place's trials
            choosing.prefill(ids)
        counts: dict[str, int] = {}
        _counting(store, counts)
        fits = []
        solve = costs._least_squares
        monkeypatch.setattr(costs, "_least_squares", lambda: fits.append(1) or solve())
        got = choosing.prefill(ids, budget=0.25)  # a partial budget on a device: a full load, exact
    plan = choosing.last_split
    assert plan is not None and plan.kind == FULL and plan.measured
    assert counts == {"lookup": 1, "load": 1}  # the choice's one lookup; no layered open, no second lookup
    assert fits == [1]  # the fit of the prefill just observed, once; choosing itself solved nothing
    assert got.loaded_tokens == expected.loaded_tokens == PREFIX
    assert torch.equal(got.logits, expected.logits)


def test_forced_paths_are_filed_too_so_an_engine_sharing_the_model_starts_informed(
    lm: LoadedModel, config: StoreConfig
) -> None:
    ids = _ids(3)
    costs = CostModel()
    with TieredStore(config) as store:
        _engine(lm, None, costs=costs, clock=PlanClock({RECOMPUTE: 2.0})).prefill(ids)  # no store
        missed = _engine(lm, store, costs=costs, split=False, clock=PlanClock({RECOMPUTE: 90.0}))
        missed.prefill(ids)  # a miss: computed whole
        assert missed.flush_stores(30)
        loading = _engine(lm, store, costs=costs, split=False, clock=PlanClock({RECOMPUTE: 3.0}))
        for _ in range(EXPLORE_REQUESTS):  # full loads (no plan: the clock's "recompute" entry times
            loading.prefill(ids)  # them), as many as take the place past trying plans on estimates
        request = Request(len(ids), PREFIX, 1.0, lm.spec.token_bytes, BLOCK)
        assert costs.log.runs(request.key(Option(RECOMPUTE))) == 2
        assert costs.measured_s(Option(RECOMPUTE), request) == pytest.approx(2.0, abs=0.2)  # the least
        assert costs.measured_s(Option(FULL), request) == pytest.approx(3.0, abs=0.2)
        auto = _engine(lm, store, costs=costs, clock=PlanClock({RECOMPUTE: 2.0, FULL: 3.0}))
        assert auto.prefill(ids).loaded_tokens == 0 and auto.last_split is not None
        assert auto.last_split.kind == RECOMPUTE and auto.last_split.measured


@pytest.fixture
def probe_small_files(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(disk_probe, "MIN_PROBE_BYTES", 4096)  # the test's store holds a few hundred KB
    yield


@pytest.mark.usefixtures("probe_small_files")
def test_the_disk_is_probed_off_the_request_path_before_the_first_cold_request(
    lm: LoadedModel, config: StoreConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _ids(4)
    with TieredStore(config) as store:
        _store(lm, store, ids)
    costs = CostModel()
    reported: list[str] = []
    observe = costs.observe_disk_probe

    def observed(rate: float) -> None:
        reported.append(threading.current_thread().name)
        observe(rate)

    monkeypatch.setattr(costs, "observe_disk_probe", observed)
    with TieredStore(config) as store:  # reopened: the prefix is on disk only
        engine = _engine(lm, store, costs=costs)
        probe = costs.disk_probe
        assert probe is not None and probe.path == store_data_file(config.data_dir or "")
        assert probe.join(30)
        if probe.error:
            pytest.skip(f"O_DIRECT refused here: {probe.error}")
        assert reported == ["kvsieve-disk-probe"]  # on its own thread, never the request's
        engine.prefill(ids)
    assert engine.last_split is not None and "(probed)" in engine.last_split.reason
    assert _engine(lm, None, costs=costs) and costs.disk_probe is probe  # once per cost model


def test_read_rate_times_the_file_with_the_injected_clock(tmp_path: Path) -> None:
    path = tmp_path / "data.mdb"
    path.write_bytes(np.random.default_rng(0).bytes(3 * disk_probe.READ_BYTES))
    ticks = iter([10.0, 10.5])
    try:
        rate = disk_probe.read_rate(path, 2 * disk_probe.READ_BYTES, clock=lambda: next(ticks))
    except OSError as exc:
        pytest.skip(f"O_DIRECT refused here: {exc}")
    assert rate == 2 * disk_probe.READ_BYTES / 0.5  # read up to the limit, not the whole file
