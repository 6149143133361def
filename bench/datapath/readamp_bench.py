"""`kvsieve bench readamp`: importance layout vs natural layout, and scorers vs baselines.

Real KV and real attention from SmolLM2-135M over 20 windows of 1,024 tokens of
Debian's license texts (bench/common/texts.py). For budgets 0.1, 0.25 and 0.5, in one run:
read amplification of the exact top tokens (bytes of the chunks holding them / their
bytes) with the natural and the importance layout; what the store's loads really
deliver and read (fractions of the prefix's tokens and bytes; whole chunks, best
first); teacher-forced quality against the full prefix (top-1 agreement and mean KL
over 32 continuation tokens) for kvsieve's prefill scorer and the baselines, and for
budget=auto; load time at each budget against budget 1.0, cold.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common.texts import token_windows
from bench.datapath.page_cache import make_cold
from importance.layout import budget_to_tokens
from importance.scorers import (
    PrefillScorer,
    PrefixEvidence,
    RandomScorer,
    RawMassScorer,
    RecentScorer,
    Scorer,
    SinkRecentScorer,
)
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

BUDGETS = (0.1, 0.25, 0.5)
SCORERS: tuple[Scorer, ...] = (
    PrefillScorer(),
    RandomScorer(),
    RecentScorer(),
    SinkRecentScorer(),
    RawMassScorer(),
)
NAMES = {"prefill": "importance", "random": "random", "recent": "recent", "sink_recent": "sink_recent",
         "raw_mass": "raw_mass"}  # fmt: skip
CONTINUATION = 32


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench readamp --json` prints."""
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    n, count = (512, 3) if quick else (1024, 20)
    quality: dict[tuple[str, float | str], list[tuple[float, float]]] = {}
    amp: dict[tuple[str, float | str], list[float]] = {}
    times: dict[float, list[float]] = {}
    for _, ids in token_windows(lm.tokenizer, n + 1, count, tail=CONTINUATION):
        with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
            _one_prefix(lm, ids, n, Path(tmp), quality, amp, times)
    return _summary(lm, n, count, quality, amp, times)


def _one_prefix(lm: Any, ids: list[int], n: int, tmp: Path, quality: Any, amp: Any, times: Any) -> None:
    from engine_adapter.runner.engine import Engine

    prefix, continuation = ids[: n + 1], ids[n + 1 :]
    kv16, evidence = _prefill(lm, prefix[:n])
    config = StoreConfig(data_dir=tmp / "store", memory_bytes=1 << 30, layout="importance")  # its subject
    with TieredStore(config) as store:
        for scorer in SCORERS:
            store.store(prefix[:n], kv16, model=lm.spec, namespace=scorer.name, scores=scorer.score(evidence))
        reference = Engine(lm, store, namespace="prefill", collect_stats=False).continuation_logits(
            prefix, continuation, 1.0
        )
        for scorer in SCORERS:
            engine = Engine(lm, store, namespace=scorer.name, collect_stats=False)
            for budget in (*BUDGETS, "auto") if scorer.name == "prefill" else BUDGETS:
                logits = engine.continuation_logits(prefix, continuation, budget)
                quality.setdefault((scorer.name, budget), []).append(_agreement(reference, logits))
        for budget in (*BUDGETS, "auto"):
            with store.load(prefix[:n], model=lm.spec, namespace="prefill", budget=budget) as stream:
                list(stream)
            amp.setdefault(("delivered", budget), []).append(stream.delivered_fraction)
            amp.setdefault(("read", budget), []).append(stream.read_fraction)
            amp.setdefault(("coverage", budget), []).append(stream.estimated_coverage)
        for budget in BUDGETS:
            for layout in ("importance", "natural"):
                amp.setdefault((layout, budget), []).append(
                    _exact_top_read_amp(store, evidence, n, budget, lm.spec.token_bytes, layout)
                )
    for budget in (*BUDGETS, 1.0):
        times.setdefault(budget, []).append(_cold_load_s(config, prefix[:n], lm.spec, budget))


def _prefill(lm: Any, tokens: list[int]) -> tuple[np.ndarray, PrefixEvidence]:
    """Real KV (fp16, layer-major) and attention evidence of one prefix."""
    from engine_adapter.runner.engine import Engine

    kv16, stats = Engine(lm, None).analyze(tokens)
    evidence = PrefixEvidence(len(tokens), prefill_normalized=stats.prefill, prefill_raw=stats.prefill_raw)
    return kv16, evidence


def _exact_top_read_amp(
    store: TieredStore, evidence: PrefixEvidence, n: int, budget: float, token_bytes: int, layout: str
) -> float:
    """Bytes of the chunks holding exactly the top `budget` tokens / bytes of those tokens.

    The top tokens are ranked across blocks by prefill score; "importance" stores
    each block in descending score order (as the store does), "natural" in prompt
    order. This is the layout's read amplification for a token-exact selection
    (loads themselves read whole chunks and deliver them: see delivered_fraction_*).
    """
    config = store.config
    scores = PrefillScorer().score(evidence)
    blocks = [scores[i : i + config.block_tokens] for i in range(0, n, config.block_tokens)]
    if layout == "importance":
        blocks = [np.sort(b)[::-1] for b in blocks]  # importance_order: descending score
    flat = np.concatenate(blocks).astype(np.float64)
    slots = np.concatenate([np.arange(len(b)) for b in blocks])
    block_of = np.concatenate([np.full(len(b), i) for i, b in enumerate(blocks)])
    wanted = budget_to_tokens(budget, n)
    top = np.lexsort((block_of, slots, -flat))[:wanted]
    chunks = {(int(block_of[t]), int(slots[t]) // config.chunk_tokens) for t in top}
    lmdb = store.stats().tiers["lmdb"]
    chunk_bytes = lmdb.used_bytes / lmdb.num_chunks
    return float(len(chunks) * chunk_bytes / (wanted * token_bytes))


def _cold_load_s(config: StoreConfig, tokens: list[int], spec: Any, budget: float) -> float:
    make_cold(config.lmdb_dir / "data.mdb", drop_all=False)  # type: ignore[operator]
    with TieredStore(config) as store:
        t0 = time.perf_counter()
        with store.load(tokens, model=spec, namespace="prefill", budget=budget) as stream:
            stream.gather(spec)
        return time.perf_counter() - t0


def _agreement(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    top1 = float((reference.argmax(-1) == other.argmax(-1)).float().mean())
    p = torch.log_softmax(reference.float(), dim=-1)
    q = torch.log_softmax(other.float(), dim=-1)
    return top1, float((p.exp() * (p - q)).sum(dim=-1).mean())


def _summary(lm: Any, n: int, count: int, quality: Any, amp: Any, times: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": lm.spec.name, "text": "Debian /usr/share/common-licenses"}
    out |= {"prefixes": count, "prefix_tokens": n, "continuation_tokens": CONTINUATION}
    full = statistics.median(times[1.0])
    for budget in BUDGETS:
        tag = f"{budget:g}".replace(".", "_")
        for layout in ("importance", "natural"):
            out[f"read_amp_{layout}_{tag}"] = round(float(np.mean(amp[(layout, budget)])), 4)
        out[f"bytes_read_fraction_importance_{tag}"] = round(budget * out[f"read_amp_importance_{tag}"], 4)
        out[f"bytes_read_fraction_natural_{tag}"] = round(budget * out[f"read_amp_natural_{tag}"], 4)
        for scorer in SCORERS:
            pairs = quality[(scorer.name, budget)]
            out[f"top1_{NAMES[scorer.name]}_{tag}"] = round(float(np.mean([p[0] for p in pairs])), 4)
            out[f"kl_{NAMES[scorer.name]}_{tag}"] = round(float(np.mean([p[1] for p in pairs])), 4)
        out[f"load_time_ratio_{tag}"] = round(statistics.median(times[budget]) / full, 3)
    for named in (*BUDGETS, "auto"):
        tag = named if isinstance(named, str) else f"{named:g}".replace(".", "_")
        for kind in ("delivered", "read"):
            out[f"{kind}_fraction_{tag}"] = round(float(np.mean(amp[(kind, named)])), 4)
        out[f"estimated_coverage_{tag}"] = round(float(np.mean(amp[("coverage", named)])), 4)
    pairs = quality[("prefill", "auto")]
    out["top1_importance_auto"] = round(float(np.mean([p[0] for p in pairs])), 4)
    out["kl_importance_auto"] = round(float(np.mean([p[1] for p in pairs])), 4)
    out["load_s_budget_1"] = round(full, 4)
    return out
