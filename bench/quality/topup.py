"""A bounded top-up during decoding, simulated (issue 9, deliverable 4; docs/importance.md).

`qa_lowbit2` chooses each layer's chunks once, from the question's queries. The
top-up starts from exactly that choice; then, at each decoding step t (answer
token t's query, in each layer), the same 2-bit key summary estimates every
chunk's share of that query's attention over the prefix, and the missing chunks
whose share exceeds `theta` are fetched, largest share first, while the layer's
fetched tokens stay within `cap` of the prefix's tokens. A chunk fetched at step t
is visible to query t and every later one, never to earlier ones (per query row
masks: bench/quality/masking.py `RowExtender`).

    PYTHONPATH=$PWD OPENBLAS_NUM_THREADS=1 python -m bench.quality.topup --windows 6 --budget 0.25

Prints one JSON object (the means over every question) and, with `--records`,
appends each window's per-item figures to a file as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from bench.common.texts import token_windows
from bench.quality.masking import MaskPlan, RowExtender, masking
from bench.quality.methods import PrefixState, chooser, summary_charge
from bench.quality.quality_bench import (
    QUESTIONS,
    SHIPPED_CONFIG,
    agreement,
    forward,
    prefix_state,
    question_item,
)
from importance.summaries import ChunkLayout, FixedBudget, chunk_mass

Array = np.ndarray[Any, Any]
SUMMARY = "lowbit2"
#: The extra tokens one layer may fetch during an answer, as a fraction of the prefix's tokens.
CAP = 0.1
THETAS = (0.05, 0.1)


@dataclass(frozen=True)
class TopUp:
    """What the top-up rule gave one layer.

    Attributes:
        rows: (query rows, prefix) bool: what each query row sees.
        fetched_tokens: prefix tokens fetched beyond the first choice (never above the cap).
    """

    rows: Array
    fetched_tokens: int


def top_up(
    base: Array, shares: Array, layout: ChunkLayout, theta: float, cap_tokens: int, first_row: int
) -> TopUp:
    """Apply the top-up rule to one layer.

    Args:
        base: (prefix,) bool, the layer's first choice (whole chunks of `layout`).
        shares: (query rows, chunks) each chunk's estimated share of each row's attention.
        layout: the chunks (prompt order).
        theta: fetch a missing chunk only if its share for the current row exceeds this.
        cap_tokens: the most tokens fetched over all rows.
        first_row: the first decoding row (earlier rows are the prompt: they see `base`).

    Raises:
        ValueError: shapes that do not match, or a negative cap.
    """
    base = np.asarray(base, dtype=bool).reshape(-1)
    shares = np.asarray(shares, dtype=np.float64)
    if base.shape[0] != layout.num_tokens or shares.ndim != 2 or shares.shape[1] != layout.num_chunks:
        raise ValueError(
            f"base {base.shape} and shares {shares.shape} do not match {layout.num_chunks} chunks"
        )
    if cap_tokens < 0:
        raise ValueError(f"cap_tokens must be >= 0, got {cap_tokens}")
    of_token = layout.chunk_of_token()
    have = np.zeros(layout.num_chunks, dtype=bool)
    have[of_token[base]] = True
    start = have.copy()
    fetched = 0
    rows = np.empty((shares.shape[0], layout.num_tokens), dtype=bool)
    for row in range(shares.shape[0]):
        if row >= first_row:
            for chunk in np.argsort(-shares[row], kind="stable"):
                if shares[row, chunk] <= theta:
                    break
                size = int(layout.sizes[chunk])
                if not have[chunk] and fetched + size <= cap_tokens:
                    have[chunk], fetched = True, fetched + size
        rows[row] = base | (have & ~start)[of_token]
    return TopUp(rows, fetched)


def extender(state: PrefixState, theta: float, first_row: int, cap: float = CAP) -> RowExtender:
    """The top-up as a `RowExtender`: shares from each row's query against the 2-bit summary."""
    cap_tokens = int(np.floor(cap * state.num_tokens + 1e-9))

    def extend(layer: int, queries: Array, base: Array) -> Array:
        summary = state.summaries(SUMMARY, SHIPPED_CONFIG)[layer]
        logits = summary.chunk_logits(queries, state.scale)  # (query heads, rows, chunks)
        kv_heads = state.keys[layer].shape[0]
        shares = np.concatenate(
            [chunk_mass(logits[:, r : r + 1], kv_heads, per_kv_head=False) for r in range(logits.shape[1])]
        )
        return top_up(base, shares, summary.layout, theta, cap_tokens, first_row).rows

    return extend


class Row(NamedTuple):
    """One compared row: `method` at `budget`, topped up at `theta` (None: no top-up)."""

    label: str
    method: str
    budget: float
    theta: float | None = None


def rows(budget: float, thetas: Sequence[float], plain_budgets: Sequence[float] = ()) -> list[Row]:
    """The first choice, the top-up at each theta, the true-attention choice, and the first
    choice at each of `plain_budgets` (the same extra bytes spent up front)."""
    first = f"qa_{SUMMARY}"
    return [
        Row(first, first, budget),
        *(Row(f"{first}_topup_{t:g}", first, budget, t) for t in thetas),
        Row("oracle", "oracle", budget),
        *(Row(f"{first}@{b:g}", first, b) for b in plain_budgets),
    ]


def compare(
    lm: Any, pairs: list[Any], state: PrefixState, question: str, jobs: Sequence[Row]
) -> dict[str, dict[str, float]]:
    """Every row's figures on one question (one batched teacher-forced pass)."""
    item = question_item(lm, pairs, question)
    n = state.num_tokens
    plans: list[MaskPlan | None] = []
    for job in jobs:
        choose = chooser(job.method, state, FixedBudget(job.budget), SHIPPED_CONFIG)
        extend = None if job.theta is None else extender(state, job.theta, item.observe)
        plans.append(MaskPlan(n, item.observe, choose, extend=extend))
    logits = forward(lm, pairs, item.new_ids, plans, item.checked)
    out: dict[str, dict[str, float]] = {}
    for job, plan, row in zip(jobs, plans, logits, strict=True):
        assert plan is not None
        figures = agreement(item.reference, row)
        summary = summary_charge(job.method, state, FixedBudget(job.budget), SHIPPED_CONFIG)
        first = float(np.mean([k.mean() for k in plan.kept.values()]))
        figures["delivered_first_choice"] = first + summary
        figures["delivered"] = plan.delivered_tokens_fraction() + summary
        figures["extra"] = figures["delivered"] - figures["delivered_first_choice"]
        out[job.label] = figures
    return out


def run(windows: int, first: int, jobs: Sequence[Row], questions: int, sink: Path | None) -> dict[str, Any]:
    """Mean figures per row over `windows` windows x `questions` questions."""
    from bench.quality.quality_bench import CONTINUATION, PREFIX, SYSTEM
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    head = lm.tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    records: dict[str, list[dict[str, float]]] = {}
    with masking(lm.model), torch.inference_mode():
        # the same windows and prompts as bench/quality/quality_bench.py's `evaluate`
        chosen = token_windows(lm.tokenizer, PREFIX + CONTINUATION, first + windows)[first:]
        for number, (name, ids) in enumerate(chosen):
            print(f"topup: window {number + 1}/{windows} {name}", file=sys.stderr, flush=True)
            pairs, state = prefix_state(lm, (head + ids)[:PREFIX])
            window = [compare(lm, pairs, state, q, jobs) for q in QUESTIONS[:questions]]
            for figures in window:
                for label, values in figures.items():
                    records.setdefault(label, []).append(values)
            if sink is not None:
                with sink.open("a") as fh:
                    fh.write(json.dumps({"window": name, "items": window}) + "\n")
    return summarise(records) | {"windows": windows, "budget": jobs[0].budget, "cap": CAP}


def summarise(records: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Means per row and figure, rounded."""
    return {
        label: {f: round(float(np.mean([r[f] for r in rows])), 4) for f in rows[0]} | {"items": len(rows)}
        for label, rows in records.items()
    }


def summarise_file(path: Path) -> dict[str, Any]:
    """The means over the windows a (possibly stopped) run appended to `path`."""
    lines = path.read_text().splitlines()
    records: dict[str, list[dict[str, float]]] = {}
    for line in lines:
        for figures in json.loads(line)["items"]:
            for label, values in figures.items():
                records.setdefault(label, []).append(values)
    return summarise(records) | {"windows": len(lines)}


def main() -> None:
    """Run the comparison and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--first", type=int, default=0, help="skip this many windows")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--thetas", default=",".join(f"{t:g}" for t in THETAS))
    parser.add_argument("--plain-budgets", default="", help="also the first choice at these budgets")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--records", type=Path, default=None, help="append each window's figures here")
    parser.add_argument("--summarise", type=Path, default=None, help="only summarise a --records file")
    args = parser.parse_args()
    if args.summarise is not None:
        print(json.dumps(summarise_file(args.summarise), indent=1))
        return
    thetas = [float(t) for t in args.thetas.split(",") if t]
    jobs = rows(args.budget, thetas, [float(b) for b in args.plain_budgets.split(",") if b])
    print(json.dumps(run(args.windows, args.first, jobs, args.questions, args.records), indent=1))


if __name__ == "__main__":
    main()
