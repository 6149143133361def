"""`generate -v`'s reuse line (engine_adapter/reuse.py): what a load saved, honestly priced."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from engine_adapter.reuse import reuse_summary


def _result(matched: int, loaded: int, load_s: float) -> SimpleNamespace:
    timings = SimpleNamespace(load_s=load_s, prefill_s=0.5)
    return SimpleNamespace(
        prompt_tokens=matched + 100, matched_tokens=matched, loaded_tokens=loaded, computed_tokens=100,
        stored_blocks=0, timings=timings,
    )  # fmt: skip


def test_a_partial_load_is_priced_against_the_whole_cached_prefix_and_its_top_up(tmp_path: Path) -> None:
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"fp": 0.002}))  # 2 ms a token here
    # a quarter of 1,024 cached tokens loaded in 0.1 s, then 3 s of topping up while decoding
    line = reuse_summary(_result(1024, 256, 0.1), "fp", rates, topup_s=3.0)
    assert "in 100 ms and 3000 ms topping up while decoding" in line
    assert "computing the 1024 cached tokens takes ~2.05 s (saved" in line
    assert "saved ~-1.05 s" in line  # it cost more than computing: said so, not a saving
    full = reuse_summary(_result(1024, 1024, 0.1), "fp", rates)
    assert "saved ~1.95 s" in full and "topping up" not in full
