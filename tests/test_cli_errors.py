"""What a new user met as tracebacks, through the real CLI (issue 45, item 6): a port in use, a
closed pipe on stdout, an empty question. Each ends in one line that names the problem."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.common.sidecar import Sidecar
from engine_adapter.commands import EMPTY_PROMPT
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore
from tests.conftest import TINY, kvsieve, make_kv, make_tokens


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port that a socket of another program listens on (no SO_REUSEPORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_serve_on_a_port_another_program_holds_is_one_line(held_port: int, tmp_path: Path) -> None:
    address = f"127.0.0.1:{held_port}"
    result = kvsieve("serve", "--listen", address, "--metrics-listen", "", "--data-dir", str(tmp_path / "d"),
                     timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert _one_line(result.stderr) == (
        f"kvsieve serve: error: {address} is already in use (another kvsieve serve, or another "
        "program, listens there): choose another --listen"
    )


def test_serve_on_a_metrics_port_in_use_names_the_metrics_flag(held_port: int, tmp_path: Path) -> None:
    result = kvsieve("serve", "--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{held_port}",
                     "--data-dir", str(tmp_path / "d"), timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert _one_line(result.stderr).endswith("choose another --metrics-listen")


def test_a_second_sidecar_on_the_first_ones_port_is_refused(tmp_path: Path) -> None:
    """gRPC listens with SO_REUSEPORT: without the check, the second would share the port and the
    kernel would spread clients over two stores."""
    first = Sidecar(tmp_path / "first").start()
    try:
        result = kvsieve("serve", "--listen", first.address, "--metrics-listen", "",
                         "--data-dir", str(tmp_path / "second"), timeout=60)  # fmt: skip
        assert result.returncode == 2
        assert f"{first.address} is already in use" in _one_line(result.stderr)
        assert first.proc is not None and first.proc.poll() is None  # the first one serves on
    finally:
        first.kill()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A store of two blocks, closed (its data directory free for `kvsieve stats`)."""
    config = StoreConfig(data_dir=tmp_path / "data", block_tokens=32, chunk_tokens=8)
    with TieredStore(config) as store:
        store.store(make_tokens(64), make_kv(TINY, 64), model=TINY)
    return config.data_dir


def test_stats_into_a_pipe_whose_reader_is_gone_ends_quietly(data_dir: Path) -> None:
    """`kvsieve stats | head -1`, with the reader gone before anything was written (deterministic)."""
    read, write = os.pipe()
    os.close(read)
    try:
        cmd = [sys.executable, "-m", "kvstore.cli.main", "stats", "--data-dir", str(data_dir)]
        result = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert result.stderr == "" and result.returncode == 141  # as a command SIGPIPE ended


def test_stats_through_head_prints_its_first_line_and_no_traceback(data_dir: Path) -> None:
    shell = f"{sys.executable} -m kvstore.cli.main stats --data-dir {data_dir} | head -1"
    result = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("blocks ") and len(result.stdout.splitlines()) == 1


@pytest.mark.parametrize("question", ["", "   ", "\n\t"])
def test_generate_refuses_an_empty_question_before_loading_the_model(question: str) -> None:
    result = kvsieve("generate", question, "--no-store", timeout=60)
    assert result.returncode == 2
    assert _one_line(result.stderr) == f"kvsieve generate: error: {EMPTY_PROMPT}"


def test_a_pipe_with_its_reader_is_not_taken_for_closed() -> None:
    """The check that tells a closed stdout from any other broken pipe (which keeps its traceback)."""
    code = "from kvstore.cli.main import _stdout_closed; print(_stdout_closed())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False"
