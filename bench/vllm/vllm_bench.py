"""`kvsieve bench vllm`: time to first token in vLLM, with and without kvsieve's connector.

A 2,048-token document (bench/common/texts.py) plus a short question, answered with one
token by vLLM (CPU build, SmolLM2-135M, default dtype and compilation), in one run:
(a) recomputed (a prompt vLLM has never seen); (b) vLLM's own in-memory prefix
cache hit (the same prompt again); (c) vLLM's reference `ExampleConnector`
loading the KV from safetensors files in a new vLLM process (restarted after the saves;
the load is then checked to use the files: `example_connector_loads_verified`); (d)
kvsieve's connector after a restart of both vLLM and the sidecar, so the blocks come
from LMDB (page cache warm, as for (c): both read their files right before their timed
loads, and `page_cache_drops` counts the drops of the page cache by other jobs during
them); (e) kvsieve's connector on a prompt nobody has seen (a miss: lookup,
compute, copy out, queue the save). (a) and (e) run side by side, one prompt in
each process in turn, with the same settings but the connector; before the next
measurement the sidecar must have received (e)'s save, so a background send
never overlaps a measured prompt. (f) kvsieve's connector again in the same new
vLLM process as (d), vLLM's own prefix cache off: the blocks now come from the
sidecar's memory tier (promoted there by (d)'s reads). Each figure is the median
over `repeats` different documents.

Where the time goes: the connector appends one line per lookup, load and save copy
to a timings file (`timings_path`, engine_adapter/vllm/timings.py). Per hit:
`hit_lookup_s` (the scheduler's lookup), `hit_fetch_s` (the sidecar's read and the
transfer, until the KV is in this process), `hit_copy_s` (into vLLM's paged cache),
`hit_vllm_s` (the rest: vLLM's own step over the question); the same `warm_*` for
(f), and per miss `miss_lookup_s`, `miss_save_copy_s` (copying the new blocks out of
vLLM's cache, in the step), `miss_vllm_s`, and `miss_store_s` (the background send,
off the request's path).

`--concurrency C` adds a load run (bench/vllm/concurrency.py): throughput and TTFT
percentiles under a stream of requests over shared documents.

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
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from bench.common.sidecar import Sidecar
from bench.common.texts import QUESTION, token_windows
from bench.common.warm import cache_drops, warm_files
from bench.vllm.concurrency import run_load, sidecar_config

DOC_TOKENS = 2048
#: Pause before each side-by-side prompt: the other process's threads and the sidecar go idle.
SETTLE_S = 0.5


class Answer(NamedTuple):
    """One measured prompt: its time to first token, that token, and the connector's timings."""

    elapsed_s: float
    first_token: int
    parts: Mapping[str, float] = MappingProxyType({})  # seconds per part (`Timings.take`)


class Timings:
    """The connector's timing records (`timings_path`), read as they are appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def take(self) -> dict[str, float]:
        """Seconds per kind of record ("lookup", "fetch", "copy", "save_copy", "store") since the
        last call, summed over the records."""
        from engine_adapter.vllm.timings import read_records

        records, self._offset = read_records(self.path, self._offset)
        parts: dict[str, float] = {}
        for r in records:
            if r["what"] == "load":
                parts["fetch"] = parts.get("fetch", 0.0) + r["fetch_s"]
                parts["copy"] = parts.get("copy", 0.0) + r["copy_s"]
            else:
                parts[r["what"]] = parts.get(r["what"], 0.0) + r["s"]
        return parts


class Setup(NamedTuple):
    """What the kvsieve modes share: the model, the prompts, vLLM's options, the sidecar, the
    connector's config (a function of the namespace) and its timings file."""

    model: Path
    prompts: list[list[int]]
    options: dict[str, Any]
    sidecar: Sidecar
    config: Any
    timings: Timings


def _median(answers: list[Answer]) -> float:
    return statistics.median(a.elapsed_s for a in answers)


def run(quick: bool = False, concurrency: int = 0) -> dict[str, Any]:
    """Run the benchmark (with a load run at `concurrency` requests in flight when > 0);
    returns the JSON object `kvsieve bench vllm --json` prints."""
    if concurrency < 0:
        raise ValueError(f"--concurrency must be >= 0, got {concurrency}")
    from engine_adapter.runner.model import load_model

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
        timings = Timings(Path(tmp) / "timings.jsonl")
        config = sidecar_config(sidecar, timings.path)
        sidecar.start()
        try:
            setup = Setup(model, prompts, options, sidecar, config, timings)
            computed, *others = _side_by_side(setup)
            example, example_verified = _example_connector(model, prompts, options, Path(tmp) / "example")
            others.append(example)
            others += _kvsieve_restart(setup)
            load = run_load(model, tokenizer, options, config, concurrency, quick) if concurrency else {}
        finally:
            sidecar.kill()
    # Each mode's answers, one per document, in the documents' order.
    names = ("kvsieve_miss", "prefix_cache", "example_connector", "kvsieve_restart", "kvsieve_warm")
    modes = dict(zip(names, others, strict=True))
    ttft = {"recompute": _median(computed)} | {mode: _median(answers) for mode, answers in modes.items()}
    out: dict[str, Any] = {f"ttft_{mode}_s": round(ttft[mode], 4) for mode in ttft}
    out["miss_overhead"] = round(ttft["kvsieve_miss"] / ttft["recompute"], 3)
    out["speedup_restart_vs_recompute"] = round(ttft["recompute"] / ttft["kvsieve_restart"], 2)
    # A speed is compared only with a load shown to use what it stored (see `_example_connector`).
    out["example_connector_loads_verified"] = example_verified
    vs_example = ttft["example_connector"] / ttft["kvsieve_restart"]
    out["kvsieve_vs_example_connector"] = round(vs_example, 2) if example_verified else None
    out["page_cache_drops"] = _cache_drops(modes)
    out["kvsieve_vs_prefix_cache"] = round(ttft["kvsieve_restart"] / ttft["prefix_cache"], 2)
    out["kvsieve_warm_vs_prefix_cache"] = round(ttft["kvsieve_warm"] / ttft["prefix_cache"], 2)
    out |= breakdown("hit", modes["kvsieve_restart"], ("lookup", "fetch", "copy"))
    out |= breakdown("warm", modes["kvsieve_warm"], ("lookup", "fetch", "copy"))
    out |= breakdown("miss", modes["kvsieve_miss"], ("lookup", "save_copy"), background=("store",))
    by_mode = {mode: first_token_mismatches(computed, answers) for mode, answers in modes.items()}
    out["first_token_mismatches"] = sum(by_mode.values())
    out["first_token_mismatches_by_mode"] = by_mode
    out |= {
        "prompt_tokens": len(prompts[0]),
        "documents": repeats,
        "compiled": not quick,
        "model": model.name,
    }
    return out | load


def _cache_drops(modes: dict[str, list[Answer]]) -> int:
    """Drops of the page cache by other jobs during (c)'s and (d)'s timed loads (which then read the disk)."""
    return sum(int(modes[m][0].parts.get("cache_drops", 0)) for m in ("example_connector", "kvsieve_restart"))


def breakdown(
    prefix: str, answers: list[Answer], parts: tuple[str, ...], background: tuple[str, ...] = ()
) -> dict[str, float]:
    """Median seconds per part of the answers' time to first token, `{prefix}_vllm_s` the rest
    (vLLM's own work); `background` parts are off the request's path (not subtracted)."""
    out = {}
    for part in (*parts, *background):
        out[f"{prefix}_{part}_s"] = round(statistics.median(a.parts.get(part, 0.0) for a in answers), 4)
    rest = [a.elapsed_s - sum(a.parts.get(part, 0.0) for part in parts) for a in answers]
    out[f"{prefix}_vllm_s"] = round(statistics.median(rest), 4)
    return out


def first_token_mismatches(reference: list[Answer], answers: list[Answer]) -> int:
    """Documents whose first token differs from the reference's (recompute's)."""
    if len(reference) != len(answers):
        raise ValueError(f"{len(answers)} answers for {len(reference)} documents")
    return sum(a.first_token != r.first_token for r, a in zip(reference, answers, strict=True))


def _ttft(driver: Any, prompt: list[int], timings: Timings | None = None) -> Answer:
    if timings is not None:
        timings.take()  # whatever came before this prompt is not its time
    reply = driver.ask([prompt], max_tokens=1)
    parts = timings.take() if timings is not None else {}
    return Answer(float(reply["elapsed_s"]), int(reply["outputs"][0][0]), parts)


def _driver(model: Path, config: dict[str, Any] | None, options: dict[str, Any], **extra: Any) -> Any:
    from engine_adapter.vllm.driver import DriverProcess

    driver = DriverProcess(model, config, **options, **extra)
    driver.wait_ready()
    _ttft(driver, [1, 2, 3])  # the first request of a process pays one-off setup: not measured
    return driver


def _side_by_side(run: Setup) -> tuple[list[Answer], list[Answer], list[Answer]]:
    """(recompute, kvsieve miss, prefix-cache hit): two processes alike but for the connector,
    both with vLLM's prefix cache on, asked each new document in turn; then plain vLLM again."""
    model, prompts, options, sidecar, config, timings = run
    from engine_adapter.vllm.driver import DriverProcess
    from kvstore.client.kvclient import KVClient

    plain = DriverProcess(model, None, **options, prefix_caching=True)
    kvsieve = DriverProcess(model, config("default"), **options, prefix_caching=True)
    try:
        computed, missed = [], []
        for driver in (plain, kvsieve):  # both started at once: the starts overlap
            driver.wait_ready()
            _ttft(driver, [1, 2, 3])  # the first request of a process pays one-off setup: not measured
        with KVClient(sidecar.address) as client:
            for i, p in enumerate(prompts):
                # Which process goes first alternates, and each prompt starts on a settled machine
                # (SETTLE_S after the last one and after the sidecar's write): on 2 shared cores the
                # process timed right after another one's prompt was up to 2.5x slower, either way.
                if i % 2 == 0:
                    computed.append(_settled(plain, p))
                miss = _settled(kvsieve, p, timings)  # a lookup that misses, then compute and save
                _wait_stores(client, i + 1)
                missed.append(miss._replace(parts={**miss.parts, **timings.take()}))  # + the background send
                if i % 2 == 1:
                    computed.append(_settled(plain, p))
        hits = [_ttft(plain, p) for p in prompts]
    finally:
        plain.stop()
        kvsieve.stop()  # sends what it still holds (nothing: every save was awaited)
    return computed, missed, hits


def _settled(driver: Any, prompt: list[int], timings: Timings | None = None) -> Answer:
    time.sleep(SETTLE_S)
    return _ttft(driver, prompt, timings)


def _wait_stores(client: Any, stores: int, timeout_s: float = 120) -> None:
    """Wait until the sidecar has received `stores` Store calls (saves are sent in the background)."""
    deadline = time.monotonic() + timeout_s
    while client.stats().get("stores") < stores:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sidecar received {client.stats().get('stores')} of {stores} saves")
        time.sleep(0.02)


def _example_connector(
    model: Path, prompts: list[list[int]], options: dict[str, Any], path: Path
) -> tuple[list[Answer], bool]:
    """vLLM's `ExampleConnector`: one process saves each prompt's KV to safetensors files, a new
    one (a restart, as for kvsieve's (d)) loads them, timed. Then the files are overwritten with
    zeros and each prompt asked again in that process (its prefix cache is off, so the connector
    loads again): the load is verified only if every first token changes, i.e. the answers came
    from the stored KV and not from a recompute or a load that wrote nothing."""
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
    finally:
        driver.stop()
    driver = _driver(model, config, options)
    try:
        warm_files(*path.rglob("*.safetensors"))  # the page cache holds them, whatever dropped it
        before = cache_drops()
        loads = [_ttft(driver, p) for p in prompts]
        loads = [a._replace(parts={"cache_drops": cache_drops() - before}) for a in loads]
        zero_safetensors(path)
        zeroed = [_ttft(driver, p) for p in prompts]
    finally:
        driver.stop()
    return loads, all(z.first_token != a.first_token for z, a in zip(zeroed, loads, strict=True))


def zero_safetensors(path: Path) -> int:
    """Overwrite every tensor of the `.safetensors` files under `path` with zeros (same shapes and
    dtypes); the number of files."""
    import safetensors.torch
    import torch

    files = sorted(path.rglob("*.safetensors"))
    for f in files:
        tensors = safetensors.torch.load_file(f)
        safetensors.torch.save_file({k: torch.zeros_like(t) for k, t in tensors.items()}, f)
    return len(files)


def _kvsieve_restart(run: Setup) -> list[list[Answer]]:
    """Loads in a new vLLM process (its prefix cache off) of the blocks `_side_by_side` stored:
    after a sidecar restart (from LMDB), then again (from the memory tier the first reads filled)."""
    model, prompts, options, sidecar, config, timings = run
    sidecar.kill()  # the sidecar's memory tier is gone: blocks come back from LMDB
    sidecar.start()
    driver = _driver(model, config("default"), options)
    try:
        warm_files(*sidecar.data_dir.rglob("*.mdb"))  # the LMDB files: warm, as for (c)
        before = cache_drops()
        cold = [_ttft(driver, p, timings) for p in prompts]
        warm = [_ttft(driver, p, timings) for p in prompts]
        drops = cache_drops() - before
    finally:
        driver.stop()
    return [[a._replace(parts={**a.parts, "cache_drops": drops}) for a in cold], warm]
