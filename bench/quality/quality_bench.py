"""`kvsieve bench quality`: which prefix KV to read under a byte budget, and what it costs the answer.

Real KV and real attention from SmolLM2-135M over windows of 1,024 tokens of
Debian's license texts (bench/common/texts.py). Partial loads are simulated by masking
inside the attention (bench/quality/masking.py: tokens keep their true positions;
tests check the masking against real partial caches). Every method delivers the
same bytes at 0.1 / 0.25 / 0.5 of the prefix (summaries included) and at `auto`
(the shipped method's coverage rule decides, the others get what it delivered).

- continuation: teacher-forced top-1 and KL over the 32 tokens after each window
  (one new token to choose with: the query-aware methods have little to go on).
- questions: each window as a chat message, then generic questions about it; the
  full prefix's greedy 16-token answer is teacher-forced under each method:
  answer top-1 and KL, first-token agreement, and greedy exact match (a greedy
  decode reproduces the full answer exactly when every teacher-forced top-1 agrees).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from bench.common.texts import stream_windows, token_windows
from bench.quality.masking import MaskPlan, masking, plans_active
from bench.quality.methods import PrefixState, QAConfig, chooser, summary_charge
from importance.scorers import PrefillScorer, PrefixEvidence
from importance.summaries import AutoBudget, Budget, FixedBudget

BUDGETS: tuple[float | str, ...] = (0.1, 0.25, 0.5, "auto")
AUTO = AutoBudget(coverage=0.9, min_fraction=0.1, max_fraction=0.5)
SUMMARIES = ("minmax", "mean", "lowbit2")
SHIPPED = "lowbit2"
#: Chosen from bench/quality/variants.py runs (docs/importance.md): 8-token chunks (the low-bit
#: summary costs the same at any chunk size), one choice per layer, first and last 16 tokens kept.
SHIPPED_CONFIG = QAConfig(chunk_tokens=8, per_kv_head=False, sink_chunks=2, recent_chunks=2)
METHODS = (
    "static",
    "static_c8",
    "static_c8_edges",
    "sink_recent",
    "snapkv",
    *(f"qa_{s}" for s in SUMMARIES),
    "oracle",
)
BATCH = 12  # rows per forward pass: batching the methods is ~2x faster on CPU
#: Where each finished window's records are appended (JSON lines), if set: a long run
#: that is stopped keeps its windows, and `python -m bench.quality.quality_bench FILE` summarises them.
RECORDS_ENV = "KVSIEVE_QUALITY_RECORDS"
#: How many windows a full-size run measures (default 20): fewer for a run that must fit a time.
WINDOWS_ENV = "KVSIEVE_QUALITY_WINDOWS"
PREFIX, CONTINUATION, ANSWER = 1024, 32, 16
QUESTIONS = (
    "Summarise the text in one sentence.",
    "What is the main subject of this text?",
    "List two terms defined in the text.",
)
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@dataclass(frozen=True)
class Item:
    """One teacher-forced pass: new tokens after the prefix and what they are checked against."""

    new_ids: list[int]
    observe: int  # leading new tokens whose queries choose
    checked: int  # the last `checked` new tokens' logits are compared
    reference: torch.Tensor  # full-prefix logits of the checked rows


class Job(NamedTuple):
    """One row of the comparison: a method (shaped by `config`) at a budget, recorded as `label`.

    `auto_rule` says how a `qa_*` method meets an `auto` budget: `layer`, each layer's own
    coverage; `prefix`, the same count for every layer, the mean over layers of the shipped
    method's per-layer choice (a simulation: a layer-by-layer load cannot know it up front).
    """

    label: str
    method: str
    budget: float | str
    config: QAConfig
    auto_rule: str = "layer"


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench quality --json` prints."""
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    count, questions, prefix = (1, QUESTIONS[:1], 512) if quick else (windows(), QUESTIONS[:2], PREFIX)
    jobs = [Job(m, m, b, SHIPPED_CONFIG) for b in BUDGETS for m in METHODS]
    sink = os.environ.get(RECORDS_ENV)
    records = evaluate(lm, count, questions, jobs, f"qa_{SHIPPED}", prefix, Path(sink) if sink else None)
    out = summarise(records, METHODS, BUDGETS)
    out |= {"model": lm.spec.name, "text": "Debian /usr/share/common-licenses", "windows": count}
    out |= {"prefix_tokens": prefix, "continuation_tokens": CONTINUATION, "answer_tokens": ANSWER}
    out |= {"questions_per_window": len(questions), "shipped_summary": SHIPPED}
    out |= {"chunk_tokens": SHIPPED_CONFIG.chunk_tokens, "per_kv_head": SHIPPED_CONFIG.per_kv_head}
    out |= {"auto_coverage": AUTO.coverage}
    return out


Records = dict[tuple[str, str, str], list[dict[str, float]]]


def windows() -> int:
    """The full-size run's window count: WINDOWS_ENV if set, else 20. Raises ValueError naming a bad value."""
    text = os.environ.get(WINDOWS_ENV, "20")
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{WINDOWS_ENV} must be a positive whole number, got {text!r}")
    return int(text)


def evaluate(
    lm: Any, count: int, questions: Sequence[str], jobs: Sequence[Job], shipped: str, prefix: int = PREFIX,
    sink: Path | None = None, first: int = 0,
) -> Records:  # fmt: skip
    """Records per (workload, label, budget tag): one dict of figures per item.

    Each window is one chat message (system turn, then the document) of PREFIX tokens:
    the continuation workload goes on with the document's next tokens, the questions
    close the message and ask in a new turn. One prefill serves both.
    """
    records: Records = {}
    windows = token_windows(lm.tokenizer, prefix + CONTINUATION, first + count)
    if len(windows) < first + count:  # long prefixes (8k): no license text is that long alone
        joined = stream_windows(lm.tokenizer, prefix + CONTINUATION, first + count)
        windows = [(f"stream@{i}", ids) for i, ids in enumerate(joined)]
    windows = windows[first:]
    head = lm.tokenizer.encode(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    with masking(lm.model), torch.inference_mode():
        for number, (name, ids) in enumerate(windows):
            print(f"quality: window {number + 1}/{len(windows)} {name}", file=sys.stderr, flush=True)
            prompt = head + ids[: prefix + CONTINUATION - len(head)]
            pairs, state = prefix_state(lm, prompt[:prefix])
            window: Records = {}
            item = continuation_item(lm, pairs, prompt[prefix:])
            _compare(lm, pairs, state, item, "cont", jobs, shipped, window)
            for question in questions:
                item = question_item(lm, pairs, question)
                _compare(lm, pairs, state, item, "qa", jobs, shipped, window)
            for key, rows in window.items():
                records.setdefault(key, []).extend(rows)
            if sink is not None:
                with sink.open("a") as fh:
                    fh.write(
                        json.dumps({"window": name, "records": [[*k, v] for k, v in window.items()]}) + "\n"
                    )
    return records


def load_records(path: Path) -> Records:
    """The records a run appended to `path` (see RECORDS_ENV)."""
    records: Records = {}
    for line in path.read_text().splitlines():
        for workload, label, tag, rows in json.loads(line)["records"]:
            records.setdefault((workload, label, tag), []).extend(rows)
    return records


def prefix_state(lm: Any, ids: list[int]) -> tuple[list[Any], PrefixState]:
    """The prefix's KV as the store delivers it (fp16 -> fp32) and what the methods use."""
    from engine_adapter.runner.engine import Engine

    kv16, stats = Engine(lm, None).analyze(ids)
    kv = torch.from_numpy(kv16).float()
    pairs = [(layer[0].unsqueeze(0), layer[1].unsqueeze(0)) for layer in kv]
    static = PrefillScorer().score(PrefixEvidence(len(ids), prefill_normalized=stats.prefill))
    keys = [layer[0].numpy() for layer in kv]
    return pairs, PrefixState(keys, static, lm.spec.head_dim**-0.5)


def forward(
    lm: Any, pairs: list[Any], new_ids: Sequence[int], plans: list[MaskPlan | None], keep_rows: int = 0
) -> torch.Tensor:
    """Logits (rows, new tokens or the last `keep_rows`, vocab) of `new_ids` after the cached prefix.

    Batch row r runs under `plans[r]`'s selection; the prefix tensors are shared, not copied.
    """
    from engine_adapter.runner.cache import cache_from

    start, rows = int(pairs[0][0].shape[2]), len(plans)
    cache = cache_from(
        lm.model.config, [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in pairs]
    )
    position_ids = torch.arange(start, start + len(new_ids)).unsqueeze(0).expand(rows, -1)
    input_ids = torch.tensor([list(new_ids)]).expand(rows, -1)
    with plans_active(plans):
        out = lm.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                       logits_to_keep=keep_rows)  # fmt: skip
    return out.logits.float()


def continuation_item(lm: Any, pairs: list[Any], rest: list[int]) -> Item:
    """The document goes on: its next token is new (it chooses), 32 tokens are teacher-forced."""
    new_ids = rest[:CONTINUATION]
    return Item(new_ids, 1, CONTINUATION, forward(lm, pairs, new_ids, [None])[0])


def question_item(lm: Any, pairs: list[Any], question: str) -> Item:
    """A question turn, and the full prefix's greedy answer (up to 16 tokens, EOS included)."""
    from engine_adapter.runner.cache import cache_from

    turn = f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    asked = lm.tokenizer.encode(turn)
    start = int(pairs[0][0].shape[2])
    cache = cache_from(lm.model.config, pairs)
    logits = _last_logits(lm, asked, start, cache)
    answer: list[int] = []
    while len(answer) < ANSWER:
        answer.append(int(logits.argmax()))
        if answer[-1] in lm.eos_token_ids:
            break
        logits = _last_logits(lm, answer[-1:], start + len(asked) + len(answer) - 1, cache)
    new_ids = asked + answer[:-1]
    reference = forward(lm, pairs, new_ids, [None], len(answer))[0]
    return Item(new_ids, len(asked), len(answer), reference)


def _last_logits(lm: Any, ids: list[int], start: int, cache: Any) -> torch.Tensor:
    position_ids = torch.arange(start, start + len(ids)).unsqueeze(0)
    out = lm.model(
        input_ids=torch.tensor([ids]), position_ids=position_ids, past_key_values=cache, use_cache=True
    )
    return out.logits[0, -1]


def _compare(
    lm: Any, pairs: list[Any], state: PrefixState, item: Item, workload: str, jobs: Sequence[Job],
    shipped: str, records: Records,
) -> None:  # fmt: skip
    """Every job on one item, in batches; `auto` rows of other methods after the shipped one's."""
    later = [j for j in jobs if j.budget == "auto" and j.method != "oracle" and not _own_auto(j)]
    later += [j for j in jobs if j.budget == "auto" and j.method == "oracle"]
    first = [j for j in jobs if j not in later]
    for batch in [first[i : i + BATCH] for i in range(0, len(first), BATCH)]:
        _run_batch(lm, pairs, state, item, batch, None, records, workload)
    shipped_auto = records[(workload, shipped, "auto")][-1]["delivered"] if later else None
    for batch in [later[i : i + BATCH] for i in range(0, len(later), BATCH)]:
        _run_batch(lm, pairs, state, item, batch, shipped_auto, records, workload)


def _run_batch(
    lm: Any, pairs: list[Any], state: PrefixState, item: Item, jobs: list[Job], shipped_auto: float | None,
    records: Records, workload: str,
) -> None:  # fmt: skip
    plans: list[MaskPlan | None] = []
    for job in jobs:
        chosen = _budget_for(job, shipped_auto)
        plans.append(MaskPlan(state.num_tokens, item.observe, chooser(job.method, state, chosen, job.config)))
    logits = forward(lm, pairs, item.new_ids, plans, item.checked)
    for job, plan, row in zip(jobs, plans, logits, strict=True):
        assert plan is not None
        figures = agreement(item.reference, row)
        figures["summary"] = summary_charge(job.method, state, _budget_for(job, shipped_auto), job.config)
        figures["delivered"] = plan.delivered_tokens_fraction() + figures["summary"]
        records.setdefault((workload, job.label, budget_tag(job.budget)), []).append(figures)


def _budget_for(job: Job, shipped_auto: float | None) -> Budget:
    """Fixed fractions as given; `auto` is the coverage rule for `qa_*`, the shipped one's bytes otherwise."""
    if job.budget != "auto":
        return FixedBudget(float(job.budget))
    if _own_auto(job):
        return AUTO
    if shipped_auto is None:
        raise ValueError("auto budgets need the shipped method in the comparison")
    return FixedBudget(min(1.0, shipped_auto))


def _own_auto(job: Job) -> bool:
    """Whether the job's method meets `auto` with its own per-layer coverage rule."""
    return job.method.startswith("qa_") and job.auto_rule == "layer"


def budget_tag(budget: float | str) -> str:
    """`0_25` for 0.25, `auto` for auto."""
    return budget if isinstance(budget, str) else f"{budget:g}".replace(".", "_")


def agreement(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement, mean KL(reference || other), first-row agreement, all-rows agreement."""
    same = reference.argmax(-1) == other.argmax(-1)
    p = torch.log_softmax(reference, dim=-1)
    q = torch.log_softmax(other, dim=-1)
    kl = float((p.exp() * (p - q)).sum(dim=-1).mean())
    return {"top1": float(same.float().mean()), "kl": kl, "first": float(same[0]), "exact": float(same.all())}


def summarise(records: Records, methods: Sequence[str], budgets: Sequence[float | str]) -> dict[str, Any]:
    """The published keys (see tests/test_bench_keys.py)."""

    def mean(workload: str, method: str, tag: str, field: str) -> float:
        return round(float(np.mean([r[field] for r in records[(workload, method, tag)]])), 4)

    out: dict[str, Any] = {}
    for budget in budgets:
        tag = budget_tag(budget)
        for m in methods:
            out[f"delivered_fraction_{m}_{tag}"] = mean("qa", m, tag, "delivered")
            out[f"cont_delivered_fraction_{m}_{tag}"] = mean("cont", m, tag, "delivered")
            out[f"top1_{m}_{tag}"] = mean("cont", m, tag, "top1")
            out[f"kl_{m}_{tag}"] = mean("cont", m, tag, "kl")
            out[f"answer_top1_{m}_{tag}"] = mean("qa", m, tag, "top1")
            out[f"answer_kl_{m}_{tag}"] = mean("qa", m, tag, "kl")
            out[f"first_token_{m}_{tag}"] = mean("qa", m, tag, "first")
            out[f"exact_match_{m}_{tag}"] = mean("qa", m, tag, "exact")
    for m in methods:  # what the summary costs where it is read (a budget below it reads none)
        if m.startswith("qa_"):
            read = [r["summary"] for k, rows in records.items() if k[1] == m for r in rows]
            out[f"summary_bytes_fraction_{m[3:]}"] = round(float(max(read)), 4)
    out["summary_bytes_fraction"] = out.get(f"summary_bytes_fraction_{SHIPPED}", 0.0)
    return out


def summarise_file(path: Path) -> dict[str, Any]:
    """The published figures of the windows a full-size run appended to `path` (see RECORDS_ENV)."""
    records = load_records(path)
    windows = len(path.read_text().splitlines())
    out = summarise(records, METHODS, BUDGETS)
    out |= {"windows": windows, "prefix_tokens": PREFIX, "shipped_summary": SHIPPED}
    out["questions_per_window"] = len(records[("qa", METHODS[0], "0_25")]) // max(windows, 1)
    return out


if __name__ == "__main__":  # summarise the windows a (possibly stopped) run appended to a file
    print(json.dumps(summarise_file(Path(sys.argv[1])), indent=1))
