"""`kvsieve bench ttft`: time to first token with and without kvsieve, on SmolLM2-135M.

Prompts are windows of 512 to 8,192 tokens of Debian's license texts
(bench/common/texts.py) plus a 32-token question (at 8,192 the window is 32 tokens shorter: the
model has 8,192 positions). In one run, per length:
(a) recompute everything; (b) load the whole prefix from the memory tier;
(c) load it from the disk tier with a cold page cache; (d) load the most
important quarter (budget 0.25); (e) the same budget from a cold store in the
layered layout, where the question's queries choose each layer's chunks
(query-aware, layer by layer inside the forward pass). Then the quality of (d) against (b): top-1
agreement and mean KL over 32 teacher-forced continuation tokens, for 10 prefixes.
`floor_s` is what (c) cannot beat at the longest length: computing the uncached
suffix plus reading the prefix's bytes at `seq_read_mb_s` (a cold sequential
read measured in the same run); `ttft_vs_floor` = (c) / floor_s.
`ttft_layered_vs_disk_N` = (e) / (c) at 2,048, 4,096 and 8,192 tokens.
`cold_read_vs_disk` (and `_layered`): at the published length, a cold full load's read of the
prefix from (c)'s store (and (e)'s, the default layout), against the disk's own cold sequential
read of the same data file (bench/datapath/cold_read.py; issue 47's target >= 0.8).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common.texts import stream_windows, token_windows
from bench.datapath.cold_read import cold_read_figures
from bench.datapath.page_cache import cold_seq_read_mb_s, make_cold
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

LENGTHS = (512, 1024, 2048, 4096, 8192)
#: Prompt lengths whose published keys compare the query-aware path with a full load.
LONG = (2048, 4096, 8192)
QUESTION_TOKENS = 32
BUDGET = 0.25
#: SmolLM2-135M's positions: the 8,192-token prompt is document + question together.
MAX_POSITIONS = 8192


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench ttft --json` prints."""
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    lengths = (256, 512) if quick else LENGTHS
    out: dict[str, Any] = {
        "model": lm.spec.name,
        "text": "Debian /usr/share/common-licenses",
        "budget": BUDGET,
    }
    top = lengths[-1] if quick else 2048  # the published *_2048 keys
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        for n in lengths:
            repeats = 1 if quick else 3 if n <= 2048 else 2
            out |= _ttft_at(lm, n, Path(tmp) / f"ttft-{n}", repeats, cold_read=n == top)
            if n in LONG:  # issue #27's target: <= 0.75 at 4,096 and 8,192, <= 1.0 at 2,048
                out[f"ttft_layered_vs_disk_{n}"] = round(
                    out[f"ttft_layered_s_{n}"] / out[f"ttft_disk_s_{n}"], 3
                )
        out["ttft_speedup_disk_2048"] = round(out[f"ttft_recompute_s_{top}"] / out[f"ttft_disk_s_{top}"], 2)
        out["ttft_speedup_budget_2048"] = round(out[f"ttft_disk_s_{top}"] / out[f"ttft_budget_s_{top}"], 2)
        out["ttft_speedup_layered_2048"] = round(out[f"ttft_disk_s_{top}"] / out[f"ttft_layered_s_{top}"], 2)
        out |= _floor(out, top, lm.spec.token_bytes, Path(tmp) / "seq.bin")
        out |= _quality(lm, Path(tmp) / "quality", 256 if quick else 1024, 3 if quick else 10)
    out |= _stats_overhead(lm, top)  # explicit attention at 8k would hold GBs of weights
    out["prefix_lengths"] = list(lengths)
    return out


def _stats_overhead(lm: Any, n: int) -> dict[str, Any]:
    """Prefill time with attention statistics (explicit attention) over without (sdpa)."""
    from engine_adapter.runner.engine import Engine

    ids = token_windows(lm.tokenizer, n, 1)[0][1]
    plain = statistics.median(_ttft(Engine(lm, None, collect_stats=False), ids, 1.0) for _ in range(2))
    stats = statistics.median(_ttft(Engine(lm, None, collect_stats=True), ids, 1.0) for _ in range(2))
    return {"stats_prefill_s": round(stats, 3), "plain_prefill_s": round(plain, 3),
            "stats_overhead": round(stats / plain, 3), "stats_overhead_tokens": n}  # fmt: skip


def _question(lm: Any) -> list[int]:
    ids = lm.tokenizer.encode(
        " Question: in one short sentence, what may a reader of the text above do? Answer:"
    )
    return (ids * 2)[:QUESTION_TOKENS]


def _ttft_at(lm: Any, n: int, data_dir: Path, repeats: int, cold_read: bool = False) -> dict[str, Any]:
    from engine_adapter.runner.engine import Engine

    length = min(n, MAX_POSITIONS - QUESTION_TOKENS)
    if n > 2048:  # no single text is this long: windows of all of them joined
        documents = stream_windows(lm.tokenizer, length, repeats)
    else:
        documents = [ids for _, ids in token_windows(lm.tokenizer, length, repeats)]
    prompts = [ids + _question(lm) for ids in documents]
    # (b)-(d) in the importance layout, as published since the first round: (d) is its static order
    config = StoreConfig(data_dir=data_dir, memory_bytes=4 << 30, layout="importance")
    recompute, memory, disk, budget, suffix = [], [], [], [], []
    layered: list[tuple[float, float]] = []
    for prompt in prompts:
        recompute.append(_ttft(Engine(lm, None, collect_stats=False), prompt, 1.0))
        with TieredStore(config) as store:
            Engine(lm, store).prefill(prompt)  # stores the prefix blocks with their prefill scores
            memory.append(_ttft(Engine(lm, store), prompt, 1.0))
        make_cold(config.lmdb_dir / "data.mdb", drop_all=False)  # type: ignore[operator]
        with TieredStore(config) as store:
            elapsed, state = _timed_prefill(Engine(lm, store), prompt, 1.0)
            disk.append(elapsed)
            suffix.append(state.timings.prefill_s)  # computing the tokens not loaded
        make_cold(config.lmdb_dir / "data.mdb", drop_all=False)  # type: ignore[operator]
        with TieredStore(config) as store:
            budget.append(_ttft(Engine(lm, store), prompt, BUDGET))
        layered.append(_layered_ttft(lm, prompt, data_dir.with_name(data_dir.name + "-layered")))
    figures = {}
    if cold_read:  # the last prompt's prefix, from the stores (c) and (e) read
        prefix = np.asarray(prompts[-1][:-1])
        layered_config = StoreConfig(
            data_dir=data_dir.with_name(data_dir.name + "-layered"), memory_bytes=4 << 30
        )
        figures = cold_read_figures(config, prefix, lm.spec) | cold_read_figures(
            layered_config, prefix, lm.spec, "_layered"
        )
    return figures | {
        f"ttft_layered_s_{n}": round(statistics.median(t for t, _ in layered), 4),
        f"layered_read_fraction_{n}": round(statistics.median(r for _, r in layered), 4),
        f"ttft_recompute_s_{n}": round(statistics.median(recompute), 4),
        f"ttft_memory_s_{n}": round(statistics.median(memory), 4),
        f"ttft_disk_s_{n}": round(statistics.median(disk), 4),
        f"ttft_budget_s_{n}": round(statistics.median(budget), 4),
        f"suffix_compute_s_{n}": round(statistics.median(suffix), 4),
    }


def _layered_ttft(lm: Any, prompt: list[int], data_dir: Path) -> tuple[float, float]:
    """(TTFT, read fraction) at BUDGET from a cold store in the layered layout (query-aware)."""
    from engine_adapter.runner.engine import Engine

    config = StoreConfig(data_dir=data_dir, memory_bytes=4 << 30, layout="layered")
    with TieredStore(config) as store:
        Engine(lm, store).prefill(prompt)
    make_cold(config.lmdb_dir / "data.mdb", drop_all=False)  # type: ignore[operator]
    with TieredStore(config) as store:
        engine = Engine(lm, store)
        elapsed = _ttft(engine, prompt, BUDGET)
        if engine.last_layered is None or engine.last_layered.error:
            raise RuntimeError("the layered store did not take the query-aware path")
        return elapsed, engine.last_layered.read_fraction


def _ttft(engine: Any, prompt: list[int], budget: float) -> float:
    return _timed_prefill(engine, prompt, budget)[0]


def _timed_prefill(engine: Any, prompt: list[int], budget: float) -> tuple[float, Any]:
    t0 = time.perf_counter()
    state = engine.prefill(prompt, budget)
    int(state.logits.argmax())
    return time.perf_counter() - t0, state


def _floor(out: dict[str, Any], n: int, token_bytes: int, seq_file: Path) -> dict[str, Any]:
    """The cold-disk floor at `n` tokens: computing the uncached suffix (measured in this
    run) plus reading the selected bytes (all n tokens) at this disk's sequential rate."""
    nbytes = n * token_bytes
    seq = cold_seq_read_mb_s(seq_file, nbytes, drop_all=False)
    floor = out[f"suffix_compute_s_{n}"] + nbytes / (seq * 1e6)
    return {
        "floor_s": round(floor, 4),
        "floor_tokens": n,
        "seq_read_mb_s": round(seq, 1),
        "ttft_vs_floor": round(out[f"ttft_disk_s_{n}"] / floor, 3),
    }


def _quality(lm: Any, data_dir: Path, n: int, count: int) -> dict[str, Any]:
    """Teacher-forced agreement of budget 0.25 with the full prefix, over `count` prefixes."""
    from engine_adapter.runner.engine import Engine

    agree, kls = [], []
    with TieredStore(StoreConfig(data_dir=data_dir, memory_bytes=4 << 30, layout="importance")) as store:
        engine = Engine(lm, store)
        # n cached tokens + 1 computed: its logits predict the first continuation token.
        for _, ids in token_windows(lm.tokenizer, n + 1, count, tail=QUESTION_TOKENS):
            prefix, continuation = ids[: n + 1], ids[n + 1 :]
            full = engine.continuation_logits(prefix, continuation, 1.0)
            part = engine.continuation_logits(prefix, continuation, BUDGET)
            agree.append(float((full.argmax(-1) == part.argmax(-1)).float().mean()))
            kls.append(_kl(full, part))
    return {
        "top1_budget_0_25": round(float(np.mean(agree)), 4),
        "kl_budget_0_25": round(float(np.mean(kls)), 4),
        "quality_prefixes": count,
        "quality_prefix_tokens": n,
        "quality_continuation_tokens": QUESTION_TOKENS,
    }


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean KL(reference || other) over rows."""
    p = torch.log_softmax(reference.float(), dim=-1)
    q = torch.log_softmax(other.float(), dim=-1)
    return float((p.exp() * (p - q)).sum(dim=-1).mean())
