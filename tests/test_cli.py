"""The command line: help for every command, and `bench store --json` on small sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import kvsieve

COMMANDS = ["generate", "run", "engine", "serve", "stats", "fsck", "relayout", "bench"]


def test_help_lists_the_commands() -> None:
    result = kvsieve("--help")
    assert result.returncode == 0
    missing = [command for command in COMMANDS if command not in result.stdout]
    assert not missing


@pytest.mark.parametrize("command", COMMANDS)
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
    missing = [key for key in published.split() if key not in figures]
    assert not missing
    assert figures["disk_load_mb_s"] > 0 and figures["codec_ratio"] > 1.0


def test_run_refuses_a_name_defined_on_one_path_only_in_one_line_with_a_caret(tmp_path: Path) -> None:
    program = tmp_path / "if.kvs"
    program.write_text('program p(a) {\n  if a == "x" { b = gen() }\n  yield b\n}\n')
    result = kvsieve("run", str(program), "--arg", "a=y", "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "kvsieve run: error: line 3, column 3: yield of unknown name 'b' " + (
        "(it is defined in only one branch of an if: define it in both, or use it inside)"
    )
    assert lines[1:] == ["    yield b", "    ^"]
    assert not (tmp_path / "data").exists()  # refused before the model or the store was opened


def test_engine_refuses_unknown_config_keys(tmp_path: Path) -> None:
    config = tmp_path / "engine.toml"
    config.write_text('[engine]\nlisten = "127.0.0.1:0"\nmetrics_listen = "0.0.0.0:9464"\n')
    result = kvsieve("engine", "--config", str(config))
    assert result.returncode == 2 and "unknown keys ['metrics_listen']" in result.stderr
