"""`kvsieve bench vllm --concurrency C`: vLLM under a stream of requests, with and without kvsieve.

A RAG service's traffic: `requests` questions about `documents` shared documents
(each request: one document, then one of several questions), in a fixed random
order, so a document's first request is a miss and its later ones are hits. Each
mode is its own vLLM process (compiled, started, measured and stopped one after
the other), sent the same stream with C requests in flight (a closed loop: a
new request as soon as one finishes; `driver.closed_loop`):

- `plain`: vLLM without prefix caching (every request computes its whole prompt);
- `prefix_cache`: vLLM with its own prefix cache;
- `kvsieve`: vLLM with its own prefix cache and kvsieve's connector (the sidecar
  starts empty for this stream);
- `prefix_cache_small` and `kvsieve_small`: the same two with the smallest cache vLLM
  accepts, one `max_model_len` (4,096 tokens, 32 blocks and vLLM's null block: under 4 of
  the 8 documents):
  vLLM's own cache evicts, kvsieve's sidecar still holds them. (With --quick's short
  documents every one fits: a smoke test only.)

Per mode: requests/s and prompt tokens/s over the run, time to first token p50 and
p99 (vLLM's own measure, from the request's arrival), and each request's first
token checked against `plain`'s (`load_first_token_mismatches`). With 24 requests,
p99 is the slowest request but one interpolated: read it as "the worst case".
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.sidecar import Sidecar
from bench.common.texts import stream_windows

#: Questions asked about each document (one per request, in turn).
QUESTIONS = (
    "\n\nQuestion: in one short sentence, what does the text above allow a reader to do?",
    "\n\nQuestion: who wrote the text above, and for whom?",
    "\n\nQuestion: name one condition the text above sets.",
)
#: Tokens per block of vLLM's CPU cache.
VLLM_CPU_BLOCK_TOKENS = 128
MODES = ("plain", "prefix_cache", "kvsieve", "prefix_cache_small", "kvsieve_small")


def stream(tokenizer: Any, documents: int, requests: int, doc_tokens: int) -> list[list[int]]:
    """The requests' prompts: each a shared document then a question, in rounds (every document
    once per round, in a seeded random order)."""
    docs = stream_windows(tokenizer, doc_tokens, documents)
    questions = [tokenizer.encode(q) for q in QUESTIONS]
    rng = random.Random(0)
    order: list[int] = []
    while len(order) < requests:
        round_ = list(range(documents))
        rng.shuffle(round_)
        order += round_
    asked = [0] * documents
    prompts = []
    for d in order[:requests]:
        prompts.append(docs[d] + questions[asked[d] % len(questions)])
        asked[d] += 1
    return prompts


def run_load(
    model: Path,
    tokenizer: Any,
    options: dict[str, Any],
    kvsieve_config: Any,
    concurrency: int,
    quick: bool,
) -> dict[str, Any]:
    """Measure every mode on the same stream; the JSON keys `kvsieve bench vllm` adds."""
    from engine_adapter.vllm.driver import DriverProcess

    doc_tokens = 256 if quick else 1024
    documents, requests = (4, 8) if quick else (8, 24)
    prompts = stream(tokenizer, documents, requests, doc_tokens)
    # vLLM refuses fewer: one request of max_model_len, and the null block it keeps aside.
    small_blocks = options["max_model_len"] // VLLM_CPU_BLOCK_TOKENS + 1
    common = {**options, "log_stats": True}
    settings: dict[str, tuple[Any, dict[str, Any]]] = {
        "plain": (None, {}),
        "prefix_cache": (None, {"prefix_caching": True}),
        "kvsieve": (kvsieve_config("load"), {"prefix_caching": True}),
        "prefix_cache_small": (None, {"prefix_caching": True, "num_blocks": small_blocks}),
        "kvsieve_small": (kvsieve_config("load-small"), {"prefix_caching": True, "num_blocks": small_blocks}),
    }
    runs: dict[str, dict[str, Any]] = {}
    for mode, (config, extra) in settings.items():
        # One process at a time: five vLLM starts at once on a small machine time out.
        driver = DriverProcess(model, config, **common, **extra)
        try:
            driver.wait_ready()
            driver.ask([[1, 2, 3]], max_tokens=1)  # one-off setup of a process: not measured
            runs[mode] = driver.closed_loop(prompts, concurrency, max_tokens=8, timeout_s=900)
        finally:
            driver.stop()
    return summarize(runs, prompts, concurrency)


def summarize(runs: dict[str, dict[str, Any]], prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
    """Throughput, TTFT percentiles and answer checks of each mode's run, and the ratios."""
    out: dict[str, Any] = {"load_concurrency": concurrency, "load_requests": len(prompts)}
    prompt_tokens = sum(map(len, prompts))
    reference = [o[0] if o else -1 for o in runs["plain"]["outputs"]]
    mismatches = {}
    for mode, run in runs.items():
        ttft = np.asarray(run["ttft_s"], dtype=np.float64)
        out[f"throughput_rps_{mode}"] = round(len(prompts) / run["elapsed_s"], 3)
        out[f"prompt_tokens_per_s_{mode}"] = round(prompt_tokens / run["elapsed_s"], 1)
        out[f"ttft_p50_s_{mode}"] = round(float(np.percentile(ttft, 50)), 4)
        out[f"ttft_p99_s_{mode}"] = round(float(np.percentile(ttft, 99)), 4)
        firsts = [o[0] if o else -1 for o in run["outputs"]]
        mismatches[mode] = sum(a != b for a, b in zip(reference, firsts, strict=True))
    out["load_first_token_mismatches"] = sum(mismatches.values())
    out["load_first_token_mismatches_by_mode"] = mismatches

    def ratio(key: str, a: str, b: str) -> float:
        return round(out[f"{key}_{a}"] / out[f"{key}_{b}"], 3)

    out["throughput_kvsieve_vs_plain"] = ratio("throughput_rps", "kvsieve", "plain")
    out["throughput_kvsieve_vs_prefix_cache"] = ratio("throughput_rps", "kvsieve", "prefix_cache")
    out["p99_ttft_kvsieve_vs_prefix_cache"] = ratio("ttft_p99_s", "kvsieve", "prefix_cache")
    out["p99_ttft_kvsieve_vs_prefix_cache_small"] = ratio("ttft_p99_s", "kvsieve_small", "prefix_cache_small")
    out["throughput_kvsieve_vs_prefix_cache_small"] = ratio(
        "throughput_rps", "kvsieve_small", "prefix_cache_small"
    )
    return out


def sidecar_config(sidecar: Sidecar, timings_path: Path | None = None) -> Any:
    """A function of a namespace: kvsieve's KVTransferConfig (as a dict) on `sidecar`."""

    def config(namespace: str) -> dict[str, Any]:
        extra: dict[str, Any] = {"store": sidecar.address, "namespace": namespace}
        if timings_path is not None:
            extra["timings_path"] = str(timings_path)
        return {
            "kv_connector": "KVSieveConnector",
            "kv_connector_module_path": "engine_adapter.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }

    return config
