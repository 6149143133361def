"""`kvsieve bench vllm`: time to first token in vLLM, with and without kvsieve's connector.

A 2,048-token document (bench/texts.py) plus a short question, answered with one
token by vLLM (CPU build, SmolLM2-135M, default dtype and compilation), in one run:
(a) recomputed (a prompt vLLM has never seen); (b) vLLM's own in-memory prefix
cache hit (the same prompt again); (c) vLLM's reference `ExampleConnector`
loading the KV from safetensors files; (d) kvsieve's connector after a restart of
both vLLM and the sidecar, so the blocks come from LMDB (page cache warm, as for
(c)); (e) kvsieve's connector on a prompt nobody has seen (a miss: lookup,
compute, copy out, queue the save). (a) and (e) run side by side, one prompt in
each process in turn, with the same settings but the connector; before the next
measurement the sidecar must have received (e)'s save, so a background send
never overlaps a measured prompt. Each figure is the median over `repeats`
different documents.
"""

from __future__ import annotations

import statistics
import tempfile
import time
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
    repeats = 3  # documents: a ratio of single runs on a shared 2-core VM is noise
    question = tokenizer.encode(QUESTION)
    prompts = [ids + question for _, ids in token_windows(tokenizer, n, repeats)]
    # --quick skips torch.compile (a start in seconds): figures are then only a smoke test.
    # 4096 tokens: the compiled graph cached under ~/.cache/vllm by default-length starts is reused.
    options: dict[str, Any] = {"eager": quick, "max_model_len": 4096}
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        sidecar = Sidecar(Path(tmp) / "kvsieve", args=["--block-tokens", "256", "--chunk-tokens", "16"])
        sidecar.start()
        try:
            recompute, miss, prefix_hit = _side_by_side(model, prompts, options, sidecar)
            example = _example_connector(model, prompts, options, Path(tmp) / "example")
            restart = _kvsieve_restart(model, prompts, options, sidecar)
        finally:
            sidecar.kill()
    figures = {
        "ttft_recompute_s": recompute,
        "ttft_prefix_cache_s": prefix_hit,
        "ttft_example_connector_s": example,
        "ttft_kvsieve_restart_s": restart,
        "ttft_kvsieve_miss_s": miss,
    }
    out: dict[str, Any] = {k: round(v, 4) for k, v in figures.items()}
    out["miss_overhead"] = round(miss / recompute, 3)
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


def _kvsieve_config(address: str) -> dict[str, Any]:
    return {
        "kv_connector": "KVSieveConnector",
        "kv_connector_module_path": "engine_adapter.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": address},
    }


def _side_by_side(
    model: Path, prompts: list[list[int]], options: dict[str, Any], sidecar: Sidecar
) -> tuple[float, float, float]:
    """(recompute, kvsieve miss, prefix-cache hit): two processes alike but for the connector,
    both with vLLM's prefix cache on, asked each new document in turn; then plain vLLM again."""
    from engine_adapter.vllm.driver import DriverProcess
    from kvstore.client.kvclient import KVClient

    plain = DriverProcess(model, None, **options, prefix_caching=True)
    kvsieve = DriverProcess(model, _kvsieve_config(sidecar.address), **options, prefix_caching=True)
    try:
        computed, missed = [], []
        for driver in (plain, kvsieve):  # both started at once: the starts overlap
            driver.wait_ready()
            _ttft(driver, [1, 2, 3])  # the first request of a process pays one-off setup: not measured
        with KVClient(sidecar.address) as client:
            for i, p in enumerate(prompts):
                computed.append(_ttft(plain, p))
                missed.append(_ttft(kvsieve, p))  # a lookup that misses, then compute and save
                _wait_stores(client, i + 1)
        hits = [_ttft(plain, p) for p in prompts]
    finally:
        plain.stop()
        kvsieve.stop()  # sends what it still holds (nothing: every save was awaited)
    return statistics.median(computed), statistics.median(missed), statistics.median(hits)


def _wait_stores(client: Any, stores: int, timeout_s: float = 120) -> None:
    """Wait until the sidecar has received `stores` Store calls (saves are sent in the background)."""
    deadline = time.monotonic() + timeout_s
    while client.stats().get("stores") < stores:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sidecar received {client.stats().get('stores')} of {stores} saves")
        time.sleep(0.02)


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


def _kvsieve_restart(
    model: Path, prompts: list[list[int]], options: dict[str, Any], sidecar: Sidecar
) -> float:
    """Loads in a new vLLM process of the blocks `_side_by_side` stored, after a sidecar restart."""
    sidecar.kill()  # the sidecar's memory tier is gone: blocks come back from LMDB
    sidecar.start()
    driver = _driver(model, _kvsieve_config(sidecar.address), options)
    try:
        loads = [_ttft(driver, p) for p in prompts]
    finally:
        driver.stop()
    return statistics.median(loads)
