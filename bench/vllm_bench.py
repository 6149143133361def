"""`kvsieve bench vllm`: time to first token in vLLM, with and without kvsieve's connector.

A 2,048-token document (bench/texts.py) plus a short question, answered with one
token by vLLM (CPU build, SmolLM2-135M, default dtype and compilation), in one run:
(a) recomputed (a prompt vLLM has never seen); (b) vLLM's own in-memory prefix
cache hit (the same prompt again); (c) vLLM's reference `ExampleConnector`
loading the KV from safetensors files; (d) kvsieve's connector after a restart of
both vLLM and the sidecar, so the blocks come from LMDB (page cache warm, as for
(c)). Each figure is the median over `repeats` different documents. Every mode
runs in its own vLLM process, one at a time.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.sidecar import Sidecar
from bench.texts import QUESTION, token_windows

DOC_TOKENS = 2048


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench vllm --json` prints."""
    from engine_adapter.model import load_model

    lm = load_model(quiet=True)
    model, tokenizer = lm.source, lm.tokenizer
    del lm
    n = 512 if quick else DOC_TOKENS
    repeats = 1 if quick else 3
    question = tokenizer.encode(QUESTION)
    prompts = [ids + question for _, ids in token_windows(tokenizer, n, repeats)]
    # --quick skips torch.compile (a start in seconds): figures are then only a smoke test.
    # 4096 tokens: the compiled graph cached under ~/.cache/vllm by default-length starts is reused.
    options: dict[str, Any] = {"eager": quick, "max_model_len": 4096}
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        recompute, prefix_hit = _plain_vllm(model, prompts, options)
        example = _example_connector(model, prompts, options, Path(tmp) / "example")
        restart = _kvsieve_restart(model, prompts, options, Path(tmp) / "kvsieve")
    figures = {
        "ttft_recompute_s": recompute,
        "ttft_prefix_cache_s": prefix_hit,
        "ttft_example_connector_s": example,
        "ttft_kvsieve_restart_s": restart,
    }
    out: dict[str, Any] = {k: round(v, 4) for k, v in figures.items()}
    out["speedup_restart_vs_recompute"] = round(recompute / restart, 2)
    out["kvsieve_vs_example_connector"] = round(example / restart, 2)
    out["kvsieve_vs_prefix_cache"] = round(restart / prefix_hit, 2)
    out |= {
        "prompt_tokens": len(prompts[0]),
        "documents": repeats,
        "compiled": not quick,
        "model": model.name,
    }
    return out


def _ttft(driver: Any, prompt: list[int]) -> float:
    return float(driver.ask([prompt], max_tokens=1)["elapsed_s"])


def _driver(model: Path, config: dict[str, Any] | None, options: dict[str, Any], **extra: Any) -> Any:
    from engine_adapter.vllm.driver import DriverProcess

    driver = DriverProcess(model, config, **options, **extra)
    driver.wait_ready()
    _ttft(driver, [1, 2, 3])  # the first request of a process pays one-off setup: not measured
    return driver


def _plain_vllm(model: Path, prompts: list[list[int]], options: dict[str, Any]) -> tuple[float, float]:
    """(recompute, prefix-cache hit): each document computed once, then asked again."""
    driver = _driver(model, None, options, prefix_caching=True)
    try:
        computed = [_ttft(driver, p) for p in prompts]  # never seen: computed in full
        hits = [_ttft(driver, p) for p in prompts]
    finally:
        driver.stop()
    return statistics.median(computed), statistics.median(hits)


def _example_connector(model: Path, prompts: list[list[int]], options: dict[str, Any], path: Path) -> float:
    path.mkdir(parents=True)
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }
    driver = _driver(model, config, options)
    try:
        for p in prompts:
            _ttft(driver, p)  # saves the prompt's KV to files
        loads = [_ttft(driver, p) for p in prompts]
    finally:
        driver.stop()
    return statistics.median(loads)


def _kvsieve_restart(model: Path, prompts: list[list[int]], options: dict[str, Any], data: Path) -> float:
    sidecar = Sidecar(data, args=["--block-tokens", "256", "--chunk-tokens", "16"]).start()
    try:
        config = {
            "kv_connector": "KVSieveConnector",
            "kv_connector_module_path": "engine_adapter.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"store": sidecar.address},
        }
        first = _driver(model, config, options)
        for p in prompts:
            _ttft(first, p)  # computes and stores the blocks
        first.stop()
        sidecar.kill()  # the sidecar's memory tier is gone: blocks come back from LMDB
        sidecar.start()
        second = _driver(model, config, options)
        try:
            loads = [_ttft(second, p) for p in prompts]
        finally:
            second.stop()
    finally:
        sidecar.kill()
    return statistics.median(loads)
