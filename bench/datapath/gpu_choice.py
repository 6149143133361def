"""The engine's own choice between loading and computing, request after request, against the best of
recompute and a full load measured beside it (issue 47): part of `kvsieve bench gpu`.

Per model shape and prefix length N (whole blocks, then a `QUESTION_TOKENS` question), `requests`
rounds; in each, side by side and in an order that turns round by round: the prompt computed whole
(no store), the prefix loaded whole (`split=False`), and the engine choosing (its own `CostModel`,
new at the start of the length, learning only from its own requests: the miss that computed and
stored the prefix, as in a process that filled its own cache, then the rounds; the disk probed when
a store with data opens, and waited for there, as a request after a start would find it). First
`requests` cold rounds (the store's files evicted from the page cache and the store reopened before
each load: every byte from the disk), then `requests` warm ones (one store, the prefix in its memory
tier), each warm round also the choosing engine at budget 0.25 (on a device, a partial budget is
query-aware only where measured faster, else the whole prefix is loaded). Keys, `{prefix}`
"cpu_seq_" on the CPU (the staged path the engine takes on a GPU, run on the CPU) and "seq_" on a
GPU, `{tag}` the shape's, each ratio taken within its round (the baselines the least of
`BASELINE_RUNS` there):

- `{prefix}split_cold_vs_best{tag}_{N}` / `..._warm_...`: the choosing engine ÷ min(recompute, full
  load), the median over rounds 2.. (after its first look); `..._first_vs_best...`: round 1;
  `..._worst_vs_best...`: the largest over rounds 2..;
- `{prefix}qa25_auto_warm_vs_full{tag}_{N}`: budget 0.25 as the engine chooses ÷ the full load, the
  median over the warm rounds;
- `{prefix}kinds_cold{tag}_{N}` / `..._warm_...`: what the engine chose, round by round;
- `{prefix}recompute_s`, `full_cold_s`, `full_warm_s{tag}_{N}`: the medians of the baselines;
- `{prefix}choice_overhead_warm_ms{tag}_{N}`: what choosing adds to a warm request that the choice
  sends to the full load (one lookup, the choice, the record), the median difference of
  `OVERHEAD_PAIRS` back-to-back pairs against the engine told to load (absent where it chose
  another plan).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from bench.datapath.page_cache import make_cold
from engine_adapter.runner.costs import CostModel
from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.engine import Engine
from engine_adapter.runner.model import LoadedModel
from engine_adapter.runner.prefill import synchronize
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

QUESTION_TOKENS = 64
PLANS = ("recompute", "full", "auto")
#: Runs of each baseline per round, the least kept (the choosing engine's request runs once: its
#: figure is one request, as a user sees it, against the best the baselines did in its round).
BASELINE_RUNS = 2
#: Back-to-back pairs of warm full loads, chosen and told, that the choice's own cost is the median of.
OVERHEAD_PAIRS = 40


class Round(NamedTuple):
    """One round: seconds of each plan, and what the choosing engine ran."""

    recompute: float
    full: float
    auto: float
    kind: str

    @property
    def vs_best(self) -> float:
        """The choosing engine ÷ the best of recompute and the full load, in this round."""
        return self.auto / min(self.recompute, self.full)


def choice_figures(
    lm: LoadedModel, tag: str, sizes: tuple[int, ...], work: Path, requests: int
) -> dict[str, Any]:
    """Every key above for `lm` (on its device; on the CPU through the staged path) over `sizes`."""
    prefix = "seq_" if lm.device.type == "cuda" else "cpu_seq_"
    warm_up = np.zeros(QUESTION_TOKENS, dtype=np.int64).tolist()
    _engine(lm, None, CostModel()).prefill(warm_up)  # a process's first forward is slow: not a miss's
    figures: dict[str, Any] = {}
    for n in sizes:
        ids = np.random.default_rng(n).integers(0, lm.model.config.vocab_size, n + QUESTION_TOKENS).tolist()
        config = StoreConfig(
            data_dir=work / f"choice{tag}_{n}", memory_bytes=3 * n * lm.spec.token_bytes + (64 << 20),
            host_arena=True,
        )  # fmt: skip
        run = _Sequence(lm, config, ids)
        with TieredStore(config) as store:
            first = _engine(lm, store, run.auto_costs)
            first.prefill(ids)  # the miss that computes and stores the prefix: its recompute measured
            first.flush_stores()
            store.flush()
        figures |= run.measure(requests, f"{prefix}%s{tag}_{n}")
    return figures


class _Sequence:
    """The rounds of one length: the choosing engine's cost model lives across them."""

    def __init__(self, lm: LoadedModel, config: StoreConfig, ids: list[int]) -> None:
        self.lm, self.config, self.ids = lm, config, ids
        self.auto_costs = CostModel()  # the choosing engine's: priors at the start
        self.overhead_ms: float | None = None

    def measure(self, requests: int, key: str) -> dict[str, Any]:
        cold = [self._cold_round(i) for i in range(requests)]
        warm, qa = self._warm_rounds(requests)
        out: dict[str, Any] = {}
        for state, rounds in (("cold", cold), ("warm", warm)):
            ratios = [r.vs_best for r in rounds]
            later = ratios[1:] or ratios
            out |= {
                key % f"split_{state}_vs_best": round(statistics.median(later), 3),
                key % f"split_{state}_first_vs_best": round(ratios[0], 3),
                key % f"split_{state}_worst_vs_best": round(max(later), 3),
                key % f"kinds_{state}": ",".join(r.kind for r in rounds),
                key % f"full_{state}_s": round(statistics.median(r.full for r in rounds), 4),
            }
        out[key % "recompute_s"] = round(statistics.median(r.recompute for r in cold + warm), 4)
        out[key % "qa25_auto_warm_vs_full"] = round(statistics.median(qa), 3)
        if self.overhead_ms is not None:
            out[key % "choice_overhead_warm_ms"] = round(self.overhead_ms, 3)
        return out

    def _cold_round(self, i: int) -> Round:
        """One cold round: each load from a store just reopened with its files out of the page cache;
        the baselines the least of `BASELINE_RUNS`, the choosing engine one request."""
        got: dict[str, float] = {}
        kind = "none"
        for plan in _turned(PLANS, i):
            runs = [self._cold_once(plan) for _ in range(1 if plan == "auto" else BASELINE_RUNS)]
            got[plan] = min(seconds for seconds, _ in runs)
            if plan == "auto":
                kind = runs[0][1]
        return Round(got["recompute"], got["full"], got["auto"], kind)

    def _cold_once(self, plan: str) -> tuple[float, str]:
        """(seconds, what the choosing engine ran) of one cold request of `plan`."""
        if plan == "recompute":
            return _timed(_engine(self.lm, None, CostModel()), self.ids), plan
        assert self.config.data_dir is not None
        make_cold(*(p for p in Path(self.config.data_dir).rglob("*") if p.is_file()), drop_all=False)
        with TieredStore(self.config) as store:
            engine = _engine(self.lm, store, self.auto_costs if plan == "auto" else CostModel(), plan)
            if engine.costs.disk_probe is not None:
                engine.costs.disk_probe.join(60)  # it runs at store open: the request comes later
            seconds = _timed(engine, self.ids)
            engine.flush_stores()
        return seconds, engine.last_split.kind if engine.last_split else plan

    def _warm_rounds(self, requests: int) -> tuple[list[Round], list[float]]:
        """The warm rounds on one store (the prefix in memory), and budget 0.25's ratios."""
        rounds, qa = [], []
        with TieredStore(self.config) as store:
            engines = {
                "recompute": _engine(self.lm, None, CostModel()),
                "full": _engine(self.lm, store, CostModel(), "full"),
                "auto": _engine(self.lm, store, self.auto_costs, "auto"),
            }
            engines["recompute"].prefill(self.ids)  # the baselines' first runs: not timed
            engines["full"].prefill(self.ids)  # (and the prefix promoted into memory)
            for i in range(requests):
                got = {plan: _best_of(engines[plan], self.ids, plan) for plan in _turned(PLANS, i)}
                split = engines["auto"].last_split
                kind = split.kind if split else "none"
                rounds.append(Round(got["recompute"], got["full"], got["auto"], kind))
                full = _timed(engines["full"], self.ids)
                qa.append(_timed(engines["auto"], self.ids, budget=0.25) / full)
            self.overhead_ms = _overhead_ms(engines["full"], engines["auto"], self.ids)
        return rounds, qa


def _best_of(engine: Engine, ids: list[int], plan: str) -> float:
    """A baseline's least of `BASELINE_RUNS`; the choosing engine's one request."""
    return min(_timed(engine, ids) for _ in range(1 if plan == "auto" else BASELINE_RUNS))


def _overhead_ms(full: Engine, auto: Engine, ids: list[int], pairs: int = OVERHEAD_PAIRS) -> float | None:
    """What choosing adds to a warm request whose choice is the full load: the median of `pairs`
    differences, each of the two engines run back to back (in turns); None where the choosing
    engine runs another plan there (then there is no same work to compare)."""
    diffs = []
    for i in range(pairs):
        order = (full, auto) if i % 2 else (auto, full)
        seconds = {id(engine): _timed(engine, ids) for engine in order}
        if auto.last_split is None or auto.last_split.kind != "full":
            return None
        diffs.append(seconds[id(auto)] - seconds[id(full)])
    return statistics.median(diffs) * 1e3


def _engine(lm: LoadedModel, store: TieredStore | None, costs: CostModel, plan: str = "auto") -> Engine:
    """An engine on the device path: a GPU's own, or on the CPU the staged path a GPU takes."""
    transfer = None if lm.device.type == "cuda" else KVTransfer(torch.device("cpu"), staging=True)
    return Engine(
        lm, store, collect_stats=False, topup=None, transfer=transfer, costs=costs, split=plan != "full",
        query_aware=False if plan == "full" else None,
    )  # fmt: skip


def _turned(plans: tuple[str, ...], i: int) -> tuple[str, ...]:
    """`plans` turned by `i`: no plan always runs first (after another's page cache, or its heat)."""
    k = i % len(plans)
    return plans[k:] + plans[:k]


def _timed(engine: Engine, ids: list[int], budget: float = 1.0) -> float:
    """Seconds of one prefill, to its logits on the device (its store queued behind it, not waited)."""
    t0 = time.perf_counter()
    engine.prefill(ids, budget=budget)
    synchronize(engine.lm.device)
    return time.perf_counter() - t0
