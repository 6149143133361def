"""The query-aware path measured through `Engine` itself: which new tokens choose the chunks
(issue #27 item 2) and the decode-time top-up (item 4).

Each window is a chat message (system turn, then 1,024 cached tokens of a Debian license
text and an uncached tail of the same text, shorter than a block), stored through a real
`TieredStore` in the layered layout; then generic questions close the message. The full
prefix's greedy answer (budget 1.0, everything loaded) is teacher-forced at budget 0.25,
where the engine takes the layer-by-layer path, for each `choose_with_last` K: answer
top-1 agreement and KL against the full prefix (bench/quality/quality_bench.py `agreement`), and the
bytes read as a fraction of the prefix's (summaries and top-ups counted). Rows:

- `all`, `last32`, `last16`, `last8`: `choose_with_last` K, no top-up (the choice alone);
- `engine`: the shipped default (`Engine(lm, store)`: K = 16, top-up at THETA within CAP,
  engine_adapter/runner/topup.py); the answer is teacher-forced one token at a time, each token's
  fetches seen by it and every later one, as `generate` decodes;
- `topup_<theta>`: the top-up at other thresholds (same cap);
- `no_topup_<budget>`: no top-up, at a larger budget (the top-up's extra bytes spent up front);
- `engine_<budget>`: the shipped default at a smaller budget (the top-up's bytes paid from the first choice).

    .venv/bin/python -m bench.quality.through_engine --windows 6 [--rows last16,engine,topup_0_05]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.texts import token_windows
from bench.quality.quality_bench import ANSWER, QUESTIONS, SYSTEM, agreement

PREFIX, BLOCK, BUDGET = 1024, 256, 0.25
#: Uncached tails (tokens of the document after its last whole block), cycled over windows.
#: At most 200, so tail + question stays inside one block and nothing of the question is stored.
TAILS = (40, 120, 200)
CHOICES: tuple[int | None, ...] = (None, 32, 16, 8)
#: Top-up thresholds measured beside the shipped one (`topup_<theta>` rows).
THETAS = (0.01, 0.05)
#: Budgets of the `no_topup_<budget>` rows: 0.3 reads about what the shipped top-up reads at 0.25 (0.28).
PLAIN_BUDGETS = (0.3,)
#: Budgets of the `engine_<budget>` rows: 0.21 reads about 0.25 with the shipped top-up.
TOPUP_BUDGETS = (0.21,)


def rows() -> dict[str, dict[str, Any]]:
    """Every row's name and the `Engine` keyword arguments that make it ({} = the shipped default),
    with the budget where a row has its own."""
    from engine_adapter.runner.topup import TopUpSettings

    out: dict[str, dict[str, Any]] = {_tag(k): {"choose_with_last": k, "topup": None} for k in CHOICES}
    out["engine"] = {}
    out |= {f"topup_{_number(t)}": {"topup": TopUpSettings(theta=t)} for t in THETAS}
    out |= {f"no_topup_{_number(b)}": {"topup": None, "budget": b} for b in PLAIN_BUDGETS}
    out |= {f"engine_{_number(b)}": {"budget": b} for b in TOPUP_BUDGETS}
    return out


def run(
    num_windows: int, questions: Sequence[str] = QUESTIONS[:2], only: Sequence[str] = ()
) -> dict[str, Any]:
    """Answer top-1, KL and bytes read per row (mean over windows x questions); the JSON object printed.

    Args:
        num_windows: documents.
        questions: asked of each.
        only: the rows to measure (names from `rows()`); empty = all.
    """
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.model import load_model
    from engine_adapter.runner.topup import TopUpSettings
    from kvstore.config import StoreConfig
    from kvstore.store.tiered import TieredStore

    jobs = rows()
    unknown = sorted(set(only) - set(jobs))
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {sorted(jobs)}")
    jobs = {name: kwargs for name, kwargs in jobs.items() if not only or name in only}
    lm = load_model(quiet=True)
    head = lm.tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    records: dict[str, list[dict[str, float]]] = {name: [] for name in jobs}
    windows = token_windows(lm.tokenizer, PREFIX + max(TAILS), num_windows)
    with tempfile.TemporaryDirectory() as tmp:
        config = StoreConfig(data_dir=Path(tmp), block_tokens=BLOCK, layout="layered")
        store = TieredStore(config)
        try:
            for number, (name, ids) in enumerate(windows):
                tail = TAILS[number % len(TAILS)]
                print(
                    f"through_engine: window {number + 1}/{len(windows)} {name} tail {tail}", file=sys.stderr
                )
                document = (head + ids)[: PREFIX + tail]
                Engine(lm, store).prefill(document)  # stores the document's whole blocks
                for question in questions:
                    _answer(lm, Engine, store, document, question, jobs, records)
        finally:
            store.close()
    out: dict[str, Any] = {"windows": len(windows), "questions_per_window": len(questions)}
    out |= {"prefix_tokens": PREFIX, "tails": list(TAILS), "budget": BUDGET, "answer_tokens": ANSWER}
    shipped = TopUpSettings()
    out |= {"topup_theta": shipped.theta, "topup_cap": shipped.cap}
    for tag, values in records.items():
        for figure, field in (
            ("answer_top1", "top1"), ("answer_kl", "kl"), ("first_token", "first"),
            ("read_fraction", "read"), ("topup_fraction", "topup"),
        ):  # fmt: skip
            out[f"{figure}_{tag}"] = round(float(np.mean([r[field] for r in values])), 4)
    return out


def _answer(
    lm: Any, engine_cls: Any, store: Any, document: list[int], question: str,
    jobs: dict[str, dict[str, Any]], records: dict[str, Any],
) -> None:  # fmt: skip
    """One question: the full-prefix answer, then each row's teacher-forced logits against it."""
    from engine_adapter.runner.sampling import Sampling

    turn = f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    prompt = document + lm.tokenizer.encode(turn)
    full = engine_cls(lm, store)
    answer = full.generate(prompt, Sampling(max_tokens=ANSWER, temperature=0.0), budget=1.0)
    if answer.matched_tokens != PREFIX:
        raise RuntimeError(f"matched {answer.matched_tokens} tokens, expected {PREFIX}")
    reference = full.continuation_logits(prompt, answer.token_ids, budget=1.0).float()
    for name, job in jobs.items():
        kwargs = {key: value for key, value in job.items() if key != "budget"}
        engine = engine_cls(lm, store, **kwargs)
        budget = job.get("budget", BUDGET)
        logits = engine.continuation_logits(prompt, answer.token_ids, budget=budget).float()
        report = engine.last_layered
        if report is None or report.error or report.matched_tokens != PREFIX:
            raise RuntimeError(f"{name}: the layered path was not taken ({report})")
        if report.topup_error:
            raise RuntimeError(f"{name}: the top-up stopped ({report.topup_error})")
        figures = agreement(reference, logits)
        figures |= {"read": report.read_fraction, "topup": report.topup_fraction}
        records[name].append(figures)


def _tag(k: int | None) -> str:
    return "all" if k is None else f"last{k}"


def _number(value: float) -> str:
    return f"{value:g}".replace(".", "_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6, help="windows (documents) to measure")
    parser.add_argument("--rows", default="", help="comma-separated rows to measure (default: all)")
    args = parser.parse_args()
    print(json.dumps(run(args.windows, only=[r for r in args.rows.split(",") if r])))


if __name__ == "__main__":
    main()
