"""Which new tokens should choose the chunks: measured through `Engine` itself (issue #27 item 2).

Each window is a chat message (system turn, then 1,024 cached tokens of a Debian license
text and an uncached tail of the same text, shorter than a block), stored through a real
`TieredStore` in the layered layout; then generic questions close the message. The full
prefix's greedy answer (budget 1.0, everything loaded) is teacher-forced at budget 0.25,
where the engine takes the layer-by-layer path, for each `choose_with_last` K: answer
top-1 agreement and KL against the full prefix (bench/quality_bench.py `agreement`).

    .venv/bin/python -m bench.quality_engine --windows 6
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

from bench.quality_bench import ANSWER, QUESTIONS, SYSTEM, agreement
from bench.texts import token_windows

PREFIX, BLOCK, BUDGET = 1024, 256, 0.25
#: Uncached tails (tokens of the document after its last whole block), cycled over windows.
#: At most 200, so tail + question stays inside one block and nothing of the question is stored.
TAILS = (40, 120, 200)
CHOICES: tuple[int | None, ...] = (None, 32, 16, 8)


def run(num_windows: int, questions: Sequence[str] = QUESTIONS[:2]) -> dict[str, Any]:
    """Answer top-1 and KL per K (mean over windows x questions); the JSON object printed."""
    from engine_adapter.engine import Engine
    from engine_adapter.model import load_model
    from kvstore.config import StoreConfig
    from kvstore.store.tiered import TieredStore

    lm = load_model(quiet=True)
    head = lm.tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    records: dict[str, list[dict[str, float]]] = {_tag(k): [] for k in CHOICES}
    windows = token_windows(lm.tokenizer, PREFIX + max(TAILS), num_windows)
    with tempfile.TemporaryDirectory() as tmp:
        config = StoreConfig(data_dir=Path(tmp), block_tokens=BLOCK, layout="layered")
        store = TieredStore(config)
        try:
            for number, (name, ids) in enumerate(windows):
                tail = TAILS[number % len(TAILS)]
                print(
                    f"quality_engine: window {number + 1}/{len(windows)} {name} tail {tail}", file=sys.stderr
                )
                document = (head + ids)[: PREFIX + tail]
                Engine(lm, store).prefill(document)  # stores the document's whole blocks
                for question in questions:
                    _answer(lm, Engine, store, document, question, records)
        finally:
            store.close()
    out: dict[str, Any] = {"windows": len(windows), "questions_per_window": len(questions)}
    out |= {"prefix_tokens": PREFIX, "tails": list(TAILS), "budget": BUDGET, "answer_tokens": ANSWER}
    for tag, rows in records.items():
        out[f"answer_top1_{tag}"] = round(float(np.mean([r["top1"] for r in rows])), 4)
        out[f"answer_kl_{tag}"] = round(float(np.mean([r["kl"] for r in rows])), 4)
        out[f"first_token_{tag}"] = round(float(np.mean([r["first"] for r in rows])), 4)
    return out


def _answer(
    lm: Any, engine_cls: Any, store: Any, document: list[int], question: str, records: dict[str, Any]
) -> None:
    """One question: the full-prefix answer, then each K's teacher-forced logits against it."""
    from engine_adapter.sampling import Sampling

    turn = f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    prompt = document + lm.tokenizer.encode(turn)
    full = engine_cls(lm, store)
    answer = full.generate(prompt, Sampling(max_tokens=ANSWER, temperature=0.0), budget=1.0)
    if answer.matched_tokens != PREFIX:
        raise RuntimeError(f"matched {answer.matched_tokens} tokens, expected {PREFIX}")
    reference = full.continuation_logits(prompt, answer.token_ids, budget=1.0).float()
    for k in CHOICES:
        engine = engine_cls(lm, store, choose_with_last=k)
        logits = engine.continuation_logits(prompt, answer.token_ids, budget=BUDGET).float()
        report = engine.last_layered
        if report is None or report.error or report.matched_tokens != PREFIX:
            raise RuntimeError(f"K={k}: the layered path was not taken ({report})")
        records[_tag(k)].append(agreement(reference, logits))


def _tag(k: int | None) -> str:
    return "all" if k is None else f"last{k}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6, help="windows (documents) to measure")
    print(json.dumps(run(parser.parse_args().windows)))


if __name__ == "__main__":
    main()
