"""What the cache did for one request, in one line a person can read (`kvsieve generate -v`).

Time saved is priced with this machine's own prefill rate: the rate of the last run of the
same model that computed at least one whole block, remembered in a small JSON file in the
cache directory. The rate of the current run alone would mislead when it computed only a
short question: a few tokens cost more each than a long prefill does.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

# Below this many computed tokens a run's rate is dominated by fixed costs: not remembered.
_MIN_TOKENS_FOR_RATE = 256


def reuse_summary(result: Any, fingerprint: str, rates_file: Path, topup_s: float = 0.0) -> str:
    """Describe reuse for a `GenerateResult`, remembering its prefill rate when meaningful.

    The time saved is what computing the cached prefix would cost less what the load cost,
    `topup_s` (chunks fetched while decoding) included: a partial load stands in for the whole
    cached prefix, not only for the tokens it delivered (pricing those alone made a partial load
    that topped up for seconds claim a saving)."""
    t = result.timings
    rates = _read_rates(rates_file)
    if result.computed_tokens >= _MIN_TOKENS_FOR_RATE:
        rates[fingerprint] = t.prefill_s / result.computed_tokens
        _write_rates(rates_file, rates)
    if result.loaded_tokens == 0:
        if result.stored_blocks:
            return (
                f"reuse: none yet; {result.stored_blocks} blocks stored, so the next request with "
                "this prefix loads them instead of computing them"
            )
        return "reuse: none (prompts shorter than one 256-token block are not cached; try --context FILE)"
    topped = f" and {topup_s * 1e3:.0f} ms topping up while decoding" if topup_s > 0 else ""
    line = (
        f"reuse: {result.loaded_tokens} of {result.prompt_tokens} prompt tokens loaded instead of "
        f"computed, in {t.load_s * 1e3:.0f} ms{topped}"
    )
    rate = rates.get(fingerprint)
    if rate is None:
        return line
    cached = max(result.matched_tokens, result.loaded_tokens)
    compute_s = cached * rate
    saved = compute_s - t.load_s - topup_s
    return f"{line}; computing the {cached} cached tokens takes ~{compute_s:.2f} s (saved ~{saved:.2f} s)"


def _read_rates(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, int | float) and v > 0}


def _write_rates(path: Path, rates: dict[str, float]) -> None:
    # Best effort: a read-only cache directory must not fail the request it describes.
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rates))
        tmp.replace(path)
