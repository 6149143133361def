"""The command line: help for every command, and `bench store --json` on small sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def kvsieve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_the_commands() -> None:
    result = kvsieve("--help")
    assert result.returncode == 0
    for command in ("fsck", "bench"):
        assert command in result.stdout


@pytest.mark.parametrize("command", ["fsck", "bench"])
def test_every_command_has_help(command: str) -> None:
    result = kvsieve(command, "--help")
    assert result.returncode == 0 and "usage: kvsieve" in result.stdout


def test_unknown_benchmark_is_rejected() -> None:
    result = kvsieve("bench", "nosuch")
    assert result.returncode == 2 and "invalid choice" in result.stderr


@pytest.mark.slow
def test_bench_store_prints_one_json_object_with_the_published_keys() -> None:
    result = kvsieve("bench", "store", "--json", "--quick")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    published = (
        "disk_load_mb_s seq_read_mb_s disk_vs_seq memory_load_mb_s memcpy_mb_s memory_vs_memcpy"
        " lookup_us_100 lookup_us_100k store_mb_s codec_ratio cold"
    )
    for key in published.split():
        assert key in figures
    assert figures["disk_load_mb_s"] > 0 and figures["codec_ratio"] > 1.0
