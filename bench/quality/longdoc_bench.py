"""`kvsieve bench longdoc`: the shipped partial loads on long documents, measured through `Engine`.

No simulation here: every figure is what `Engine` answers on a real `TieredStore`
(issue #27, item 1). Each window is a chat message: a system turn, then a document of
`tokens` cached tokens (whole 256-token blocks) and an uncached tail of the same text
(40/120/200 tokens: the prompt's document never ends on a block boundary), then a
generic question. The full prefix's greedy answer (everything loaded) is
teacher-forced under each method and budget:

- `engine`: the product's query-aware path: a store in the layered layout, each
  layer's chunks chosen inside the forward pass by the question's queries
  (engine_adapter/runner/layered.py), then the decode-time top-up (engine_adapter/runner/topup.py):
  the answer is teacher-forced one token at a time and each token fetches the missing
  chunks its query needs. Its bytes read count its key summaries and top-ups
  (`topup_fraction_…`: the top-up's share). Below the smallest budget the path takes
  (`MIN_LAYERED_FRACTION`, 0.2) the engine reads the layered store in the static order;
  `layered_path_…` says which share took the path.
- `static`: a store in the importance layout: every block's most important tokens
  (prefill attention), the same for every question.

Per method, length and budget: answer top-1 agreement and KL against the full prefix,
first-token agreement, continuation top-1 (the 32 tokens of the text after the
document's tail, teacher-forced), and the bytes read as a fraction of the prefix's.
`sink_recent` and the oracle are not product paths: `kvsieve bench quality` simulates
them (1,024 tokens).

Documents are the Debian license texts (bench/common/texts.py) joined into one stream and cut
into windows at different offsets, so a window of 8k tokens exists. At 8k the
document, its tail, the question and the answer fit the model's 8,192 positions.

    kvsieve bench longdoc --json          (KVSIEVE_LONGDOC_WINDOWS="4096:12,8192:8")
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.texts import stream_windows
from bench.quality.quality_bench import ANSWER, QUESTIONS, SYSTEM, agreement

BLOCK = 256
BUDGETS = (0.1, 0.25)
METHODS = ("engine", "static")
#: Uncached tails, cycled over windows: the document never ends on a block boundary.
TAILS = (40, 120, 200)
CONTINUATION = 32
#: Cached prefix tokens per length label: at 8192 the prompt must stay inside 8,192 positions.
PREFIX_OF = {1024: 1024, 4096: 4096, 8192: 7680}
DEFAULT_WINDOWS = {1024: 12, 4096: 12, 8192: 8}
WINDOWS_ENV = "KVSIEVE_LONGDOC_WINDOWS"


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench longdoc --json` prints."""
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    plan = {1024: 1} if quick else _windows_plan(os.environ.get(WINDOWS_ENV, ""))
    questions = QUESTIONS[:1] if quick else QUESTIONS[:2]
    out: dict[str, Any] = {"model": lm.spec.name, "budgets": list(BUDGETS), "methods": list(METHODS)}
    out |= {
        "answer_tokens": ANSWER,
        "continuation_tokens": CONTINUATION,
        "questions_per_window": len(questions),
    }
    for tokens, count in plan.items():
        out |= _at_length(lm, tokens, count, questions)
    out["lengths"] = list(plan)
    return out


def _windows_plan(text: str) -> dict[int, int]:
    """{length: windows} from "4096:12,8192:8" (empty: the defaults)."""
    if not text.strip():
        return dict(DEFAULT_WINDOWS)
    plan: dict[int, int] = {}
    for part in text.split(","):
        length, _, count = part.partition(":")
        if int(length) not in PREFIX_OF or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"{WINDOWS_ENV}: want LENGTH:COUNT with LENGTH in {sorted(PREFIX_OF)}, got {part!r}"
            )
        plan[int(length)] = int(count)
    return plan


def _at_length(lm: Any, tokens: int, count: int, questions: Sequence[str]) -> dict[str, Any]:
    from engine_adapter.runner.engine import Engine
    from kvstore.config import StoreConfig
    from kvstore.store.tiered import TieredStore

    prefix = PREFIX_OF[tokens]
    head = lm.tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    records: dict[tuple[str, float, str], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        stores = {
            method: TieredStore(StoreConfig(data_dir=Path(tmp) / method, block_tokens=BLOCK, layout=layout))
            for method, layout in (("engine", "layered"), ("static", "importance"))
        }
        try:
            for number, ids in enumerate(
                stream_windows(lm.tokenizer, prefix + max(TAILS) + CONTINUATION, count)
            ):
                print(f"longdoc: {tokens} tokens, window {number + 1}/{count}", file=sys.stderr, flush=True)
                tail = TAILS[number % len(TAILS)]
                document = (head + ids)[: prefix + tail]
                following = (head + ids)[prefix + tail : prefix + tail + CONTINUATION]
                for store in stores.values():
                    Engine(lm, store).prefill(document)  # stores the document's whole blocks
                for question in questions:
                    _question(lm, stores, document, question, prefix, records)
                _continuation(lm, stores, document, following, records)
                # a long run that is stopped keeps its figures so far (one JSON line per window)
                print(
                    json.dumps({"window": number + 1, **_figures(tokens, records)}),
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            for store in stores.values():
                store.close()
    return {f"windows_{tokens}": count, f"prefix_tokens_{tokens}": prefix} | _figures(tokens, records)


def _figures(tokens: int, records: dict[tuple[str, float, str], list[float]]) -> dict[str, float]:
    """The published keys: each figure's mean over windows (and questions)."""
    return {
        f"{field}_{method}_{tokens}_{_tag(budget)}": round(float(np.mean(values)), 4)
        for (method, budget, field), values in sorted(records.items())
    }


def _question(
    lm: Any, stores: dict[str, Any], document: list[int], question: str, prefix: int,
    records: dict[tuple[str, float, str], list[float]],
) -> None:  # fmt: skip
    """The full prefix's greedy answer, then each method's teacher-forced logits against it."""
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.sampling import Sampling

    turn = f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    prompt = document + lm.tokenizer.encode(turn)
    full = Engine(lm, stores["static"])
    answer = full.generate(prompt, Sampling(max_tokens=ANSWER, temperature=0.0), budget=1.0)
    if answer.matched_tokens != prefix:
        raise RuntimeError(f"matched {answer.matched_tokens} tokens, expected {prefix}")
    reference = full.continuation_logits(prompt, answer.token_ids, budget=1.0).float()
    for method, store in stores.items():
        for budget in BUDGETS:
            engine = Engine(lm, store)
            logits = engine.continuation_logits(prompt, answer.token_ids, budget=budget).float()
            figures = agreement(reference, logits)
            _add(records, method, budget, "answer_top1", figures["top1"])
            _add(records, method, budget, "answer_kl", figures["kl"])
            _add(records, method, budget, "first_token", figures["first"])
            read, layered = _read_fraction(engine, method, prefix)
            _add(records, method, budget, "read_fraction", read)
            if method == "engine":
                _add(records, method, budget, "layered_path", layered)
                report = engine.last_layered
                topup = report.topup_fraction if layered and report is not None else 0.0
                _add(records, method, budget, "topup_fraction", topup)


def _continuation(
    lm: Any, stores: dict[str, Any], document: list[int], following: list[int],
    records: dict[tuple[str, float, str], list[float]],
) -> None:  # fmt: skip
    """The text after the document, teacher-forced: top-1 against the full prefix's."""
    from engine_adapter.runner.engine import Engine

    reference = Engine(lm, stores["static"]).continuation_logits(document, following, budget=1.0).float()
    for method, store in stores.items():
        for budget in BUDGETS:
            logits = Engine(lm, store).continuation_logits(document, following, budget=budget).float()
            _add(records, method, budget, "top1", agreement(reference, logits)["top1"])


def _read_fraction(engine: Any, method: str, prefix: int) -> tuple[float, float]:
    """(bytes read / the prefix's bytes, 1.0 if the layered path was taken else 0.0), as the load
    reports them (the layered path counts its key summaries and top-ups). Below its smallest budget
    (engine_adapter/runner/layered_policy.py) the engine reads a layered store in the static order."""
    report = engine.last_layered
    if report is not None and not report.error:
        if method != "engine" or report.matched_tokens != prefix:
            raise RuntimeError(f"{method}: unexpected layered load ({report})")
        return float(report.read_fraction), 1.0
    if report is not None or engine.last_load is None:
        raise RuntimeError(f"{method}: nothing was loaded from the store ({report})")
    return float(engine.last_load.read_fraction), 0.0


def _add(
    records: dict[tuple[str, float, str], list[float]], method: str, budget: float, field: str, value: float
) -> None:
    records.setdefault((method, budget, field), []).append(value)


def _tag(budget: float) -> str:
    return f"{budget:g}".replace(".", "_")
