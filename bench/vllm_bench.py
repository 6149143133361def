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

Every mode's first token is checked against recompute's for the same document
(`first_token_mismatches`, per mode in `first_token_mismatches_by_mode`), so no
figure comes from a load that silently did nothing or wrote wrong KV. In
bfloat16 a loaded prefix may flip a near-tie, as vLLM's own prefix cache may
(docs/vllm.md, Exactness): a mismatch is reported, not raised.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from bench.sidecar import Sidecar
from bench.texts import QUESTION, token_windows

DOC_TOKENS = 2048


class Answer(NamedTuple):
    """One measured prompt: its time to first token and that token."""

    elapsed_s: float
    first_token: int


def _median(answers: list[Answer]) -> float:
    return statistics.median(a.elapsed_s for a in answers)


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
            computed, *others = _side_by_side(model, prompts, options, sidecar)
            others.append(_example_connector(model, prompts, options, Path(tmp) / "example"))
            others.append(_kvsieve_restart(model, prompts, options, sidecar))
        finally:
            sidecar.kill()
    # Each mode's answers, one per document, in the documents' order.
    modes = dict(
        zip(("kvsieve_miss", "prefix_cache", "example_connector", "kvsieve_restart"), others, strict=True)
    )
    ttft = {"recompute": _median(computed)} | {mode: _median(answers) for mode, answers in modes.items()}
    out: dict[str, Any] = {f"ttft_{mode}_s": round(ttft[mode], 4) for mode in ttft}
    out["miss_overhead"] = round(ttft["kvsieve_miss"] / ttft["recompute"], 3)
    out["speedup_restart_vs_recompute"] = round(ttft["recompute"] / ttft["kvsieve_restart"], 2)
    out["kvsieve_vs_example_connector"] = round(ttft["example_connector"] / ttft["kvsieve_restart"], 2)
    out["kvsieve_vs_prefix_cache"] = round(ttft["kvsieve_restart"] / ttft["prefix_cache"], 2)
    by_mode = {mode: first_token_mismatches(computed, answers) for mode, answers in modes.items()}
    out["first_token_mismatches"] = sum(by_mode.values())
    out["first_token_mismatches_by_mode"] = by_mode
    out |= {
        "prompt_tokens": len(prompts[0]),
        "documents": repeats,
        "compiled": not quick,
        "model": model.name,
    }
    return out


def first_token_mismatches(reference: list[Answer], answers: list[Answer]) -> int:
    """Documents whose first token differs from the reference's (recompute's)."""
    if len(reference) != len(answers):
        raise ValueError(f"{len(answers)} answers for {len(reference)} documents")
    return sum(a.first_token != r.first_token for r, a in zip(reference, answers, strict=True))


def _ttft(driver: Any, prompt: list[int]) -> Answer:
    reply = driver.ask([prompt], max_tokens=1)
    return Answer(float(reply["elapsed_s"]), int(reply["outputs"][0][0]))


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
) -> tuple[list[Answer], list[Answer], list[Answer]]:
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
    return computed, missed, hits


def _wait_stores(client: Any, stores: int, timeout_s: float = 120) -> None:
    """Wait until the sidecar has received `stores` Store calls (saves are sent in the background)."""
    deadline = time.monotonic() + timeout_s
    while client.stats().get("stores") < stores:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sidecar received {client.stats().get('stores')} of {stores} saves")
        time.sleep(0.02)


def _example_connector(
    model: Path, prompts: list[list[int]], options: dict[str, Any], path: Path
) -> list[Answer]:
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
    return loads


def _kvsieve_restart(
    model: Path, prompts: list[list[int]], options: dict[str, Any], sidecar: Sidecar
) -> list[Answer]:
    """Loads in a new vLLM process of the blocks `_side_by_side` stored, after a sidecar restart."""
    sidecar.kill()  # the sidecar's memory tier is gone: blocks come back from LMDB
    sidecar.start()
    driver = _driver(model, _kvsieve_config(sidecar.address), options)
    try:
        loads = [_ttft(driver, p) for p in prompts]
    finally:
        driver.stop()
    return loads
