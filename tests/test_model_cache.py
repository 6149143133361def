"""The model's cache directory shared by processes that load at once (pytest-xdist's workers on the
GPU machine, bench/datapath/gpu_suite.sh): fingerprints are written without stepping on each other."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from engine_adapter.runner.model import spec_from_config

PROCESSES, ROUNDS = 8, 2


def _fingerprint(config: Any, source: Path, barrier: multiprocessing.synchronize.Barrier) -> None:
    barrier.wait(30)  # every process computes and writes the fingerprints file at the same moment
    spec_from_config(config, source, "float16")


def test_processes_fingerprinting_at_once_all_succeed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (source / "tokenizer.json").write_text("{}")
    from transformers import LlamaConfig  # imported here, once: the forked processes inherit it

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    context = multiprocessing.get_context("fork")
    for round_ in range(ROUNDS):  # a fresh cache each round: every process finds no fingerprint
        monkeypatch.setenv("KVSIEVE_CACHE_DIR", str(tmp_path / f"cache{round_}"))
        barrier = context.Barrier(PROCESSES)
        workers = [
            context.Process(target=_fingerprint, args=(config, source, barrier)) for _ in range(PROCESSES)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(120)
            assert not worker.is_alive()
        assert [w.exitcode for w in workers] == [0] * PROCESSES
        cache = tmp_path / f"cache{round_}"
        assert [p.name for p in cache.iterdir()] == ["fingerprints.json"]  # no temporary file left
