"""`kvsieve bench dsl`: a workflow as one program vs as separate calls.

`examples/chatbot.kvs` and `examples/map_reduce.kvs` on a shared context of at
least 1,000 tokens (license text, bench/common/texts.py), in one run:
(a) as one program; (b) as separate stateless calls that recompute their whole
prompt (what a plain completion API does); (c) as separate calls with prefix
reuse through the store. Prefill tokens computed and wall time for each.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.texts import documents
from engine_adapter.runner.sampling import Sampling
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CRITIC = "Does the answer above break any rule of polite conversation? Answer Yes or No."
FOLLOW = "Suggest 3 short follow-up questions, one per line."


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench dsl --json` prints."""
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    text = _context(lm, 300 if quick else 1100)
    out: dict[str, Any] = {"model": lm.spec.name, "context_tokens": len(lm.tokenizer.encode(text))}
    question = text + "\n\nQuestion: in one sentence, what does this text allow?"
    out |= _compare(lm, "", "chatbot", {"question": question}, _chatbot_calls(question))
    third = len(text) // 3
    parts = {"part1": text[:third], "part2": text[third : 2 * third], "part3": text[2 * third :]}
    out |= _compare(lm, "map_reduce_", "map_reduce", parts, _map_reduce_calls(parts))
    return out


def _context(lm: Any, tokens: int) -> str:
    for _name, text in documents():
        ids = lm.tokenizer.encode(text)
        if len(ids) >= tokens:
            return str(lm.tokenizer.decode(ids[:tokens]))
    raise RuntimeError("no document long enough")


def _compare(lm: Any, prefix: str, program: str, args: dict[str, str], calls: Any) -> dict[str, Any]:
    from engine_adapter.dsl import Limits, plan
    from engine_adapter.dsl.run import ProgramRun
    from engine_adapter.runner.engine import Engine

    with (
        tempfile.TemporaryDirectory(dir=Path.home()) as tmp,
        TieredStore(StoreConfig(data_dir=Path(tmp))) as store,
    ):
        # A measurement, not a service: no run deadline (a loaded machine must not abort it).
        checked = plan((EXAMPLES / f"{program}.kvs").read_text(), Limits(deadline_s=3600.0))
        t0 = time.perf_counter()
        run_ = ProgramRun(Engine(lm, store), checked, args)
        events = list(run_.events())
        program_s, program_tokens = time.perf_counter() - t0, run_.stats.prefill_tokens
        program_decoded, program_steps = sum(run_.stats.batch_sizes), run_.stats.decode_steps
        if events[-1].kind != "done":
            raise RuntimeError(f"{program} failed: {events[-1].value}")
    stateless_s, stateless_tokens, _ = _separate_calls(Engine(lm, None, collect_stats=False), calls)
    with (
        tempfile.TemporaryDirectory(dir=Path.home()) as tmp,
        TieredStore(StoreConfig(data_dir=Path(tmp))) as store,
    ):
        cached_s, cached_tokens, cached_decoded = _separate_calls(Engine(lm, store), calls)
    return {
        f"{prefix}program_s": round(program_s, 2),
        f"{prefix}stateless_s": round(stateless_s, 2),
        f"{prefix}cached_s": round(cached_s, 2),
        f"{prefix}program_prefill_tokens": program_tokens,
        f"{prefix}stateless_prefill_tokens": stateless_tokens,
        f"{prefix}cached_prefill_tokens": cached_tokens,
        f"{prefix}speedup_vs_stateless": round(stateless_s / program_s, 3),
        f"{prefix}speedup_vs_cached": round(cached_s / program_s, 3),
        f"{prefix}prefill_ratio_vs_stateless": round(program_tokens / stateless_tokens, 3),
        # Wall times compare only when both decoded about as many tokens (answers may differ).
        f"{prefix}program_decoded_tokens": program_decoded,
        f"{prefix}program_decode_steps": program_steps,
        f"{prefix}cached_decoded_tokens": cached_decoded,
    }


def _separate_calls(engine: Any, calls: Any) -> tuple[float, int, int]:
    """Run the workflow call by call; each call's prompt depends on earlier answers.

    Returns (seconds, prompt tokens computed, tokens decoded)."""
    t0 = time.perf_counter()
    computed = decoded = 0
    answers: list[str] = []
    for build, sampling in calls:
        result = engine.generate(build(answers), sampling)
        computed += result.computed_tokens
        decoded += len(result.token_ids)
        answers.append(result.text)
    return time.perf_counter() - t0, computed, decoded


def _chatbot_calls(question: str) -> list[Any]:
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    def after_answer(extra: str) -> Any:
        return lambda answers: [
            *base,
            {"role": "assistant", "content": answers[0]},
            {"role": "user", "content": extra},
        ]

    return [
        (lambda answers: base, Sampling(max_tokens=128, stop=("\n\n",))),
        (after_answer(CRITIC), Sampling(max_tokens=2)),
        (after_answer(FOLLOW), Sampling(max_tokens=64)),
    ]


def _map_reduce_calls(parts: dict[str, str]) -> list[Any]:
    document = "Here is a document in three parts.\n\n" + "\n\n".join(
        f"Part {i}:\n{parts[f'part{i}']}" for i in (1, 2, 3)
    )
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": document}]

    def summarise(i: int) -> Any:
        return lambda answers: [*base, {"role": "user", "content": f"Summarise part {i} in one sentence."}]

    def combine(answers: list[str]) -> Any:
        listing = "\n".join(f"{i}. {a}" for i, a in enumerate(answers[:3], 1))
        return [
            *base,
            {"role": "user", "content": f"Combine these summaries into one short paragraph:\n{listing}"},
        ]

    one_line = Sampling(max_tokens=48, stop=("\n",))
    return [(summarise(1), one_line), (summarise(2), one_line), (summarise(3), one_line),
            (combine, Sampling(max_tokens=96))]  # fmt: skip
