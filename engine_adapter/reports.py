"""What `kvsieve generate -v` and `kvsieve run` print beside the answer (engine_adapter/commands.py).

Kept apart from the commands' flags and dispatch: each function formats one report of the
engine (a budget's delivery, a layer-by-layer load, the timings, a workflow's events).
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from kvstore.api import LoadStream
from kvstore.budget import AutoBudget

if TYPE_CHECKING:
    from engine_adapter.dsl.run import Event
    from engine_adapter.runner import LayeredReport, SplitPlan


def budget_words(budget: float | int | AutoBudget) -> str:
    """A budget as `generate -v` names it: `0.25`, or `auto (coverage 0.5)`."""
    return f"auto (coverage {budget.coverage})" if isinstance(budget, AutoBudget) else f"{budget}"


def print_budget(budget: float | int | AutoBudget, stream: LoadStream | None) -> None:
    """`generate -v`: what the budget really delivered and read (stderr)."""
    if stream is None:
        return
    words = budget_words(budget)
    print(
        f"budget {words}: delivered {stream.delivered_fraction:.1%} of the cached prefix's tokens, "
        f"read {stream.read_fraction:.1%} of its bytes, "
        f"estimated attention mass {stream.estimated_coverage:.1%}",
        file=sys.stderr,
    )


def print_layered(report: LayeredReport | None) -> None:
    """`generate -v`: what a layer-by-layer load chose and read, or why it fell back (stderr)."""
    if report is None:
        return
    if report.error:
        print(f"layer-by-layer load abandoned ({report.error}): prompt recomputed", file=sys.stderr)
        return
    print(
        f"layer by layer: {report.chunks_per_layer} chunks of {report.chunk_tokens} tokens per layer chosen "
        f"by the queries of the last {report.query_tokens} of {report.new_tokens} new tokens; "
        f"delivered {report.delivered_fraction:.1%} of the cached prefix's tokens, "
        f"read {report.read_fraction:.1%} of its bytes (summaries {report.summary_fraction:.1%}, "
        f"top-up {report.topup_fraction:.1%})",
        file=sys.stderr,
    )
    stopped = f"; stopped: {report.topup_error}" if report.topup_error else ""
    print(
        f"top-up while decoding: {report.topup_chunks} chunks, {report.topup_bytes} bytes, "
        f"in {report.topup_steps} steps ({report.topup_s * 1e3:.0f} ms){stopped}",
        file=sys.stderr,
    )


def print_timings(
    result: Any, budget: float | int | AutoBudget, fingerprint: str, layered: LayeredReport | None = None
) -> None:
    """`generate -v`: where the prompt's tokens came from and where the time went (stderr);
    `layered`: the layer-by-layer load's report (its top-up while decoding is part of the load)."""
    from engine_adapter.reuse import reuse_summary
    from engine_adapter.runner import cache_dir

    t = result.timings
    print(
        f"\nprompt {result.prompt_tokens} tokens: {result.matched_tokens} cached, "
        f"{result.loaded_tokens} loaded (budget {budget_words(budget)}), {result.computed_tokens} computed; "
        f"{result.stored_blocks} new blocks stored\n"
        f"lookup {t.lookup_s * 1e3:.1f} ms, load {t.load_s * 1e3:.1f} ms, "
        f"prefill {t.prefill_s * 1e3:.0f} ms, decode {t.decode_s * 1e3:.0f} ms "
        f"({len(result.token_ids)} tokens, {result.finish_reason})",
        file=sys.stderr,
    )
    topup_s = layered.topup_s if layered is not None else 0.0
    print(reuse_summary(result, fingerprint, cache_dir() / "prefill-rates.json", topup_s), file=sys.stderr)


def print_split(plan: SplitPlan | None) -> None:
    """`generate -v` on a device: how much of the cached prefix was loaded and computed, and why."""
    if plan is not None:
        print(f"load plan: {plan.reason}", file=sys.stderr)


def print_event(event: Event, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"kind": event.kind, "name": event.name, "value": event.value,
                          "elapsed_s": event.elapsed_s}), flush=True)  # fmt: skip
    elif event.kind == "yield":
        value = "\n".join(event.value) if isinstance(event.value, list) else event.value
        print(f"[{event.elapsed_s:7.2f}s] {event.name}: {value}", flush=True)
    elif event.kind == "error":
        print(f"kvsieve run: error: {event.value}", file=sys.stderr)
