"""The command line as a composition root: plugins found by entry point, defaults from dataclasses,
DSL limits from flags and KVSIEVE_* variables."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import kvsieve

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = "program p() {\n  a = gen(max_tokens=2)\n  b = gen(max_tokens=2)\n  yield a\n}\n"


def test_a_command_declared_only_by_an_installed_entry_point_is_found(tmp_path: Path) -> None:
    """A distribution that kvsieve never names adds `hello` through the `kvsieve.commands` group."""
    (tmp_path / "hello_plugin.py").write_text(
        "from kvstore.cli.flags import add_command\n\n"
        "def register(commands):\n"
        "    add_command(commands, 'hello', lambda p: p.add_argument('who'), _hello, help='say hello')\n\n"
        "def _hello(args):\n    print('hello ' + args.who)\n    return 0\n"
    )
    info = tmp_path / "hello_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hello-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[kvsieve.commands]\nhello = hello_plugin:register\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", str(ROOT))])
    listing = kvsieve("--help", env={"PYTHONPATH": path})
    assert listing.returncode == 0 and "say hello" in listing.stdout
    assert all(name in listing.stdout for name in ("generate", "run", "engine", "bench", "serve"))
    result = kvsieve("hello", "world", env={"PYTHONPATH": path})
    assert (result.returncode, result.stdout) == (0, "hello world\n"), result.stderr


def test_help_imports_no_plugin_dependency() -> None:
    code = "import sys, kvstore.cli.main as c; c._parser(); print({'torch', 'grpc'} & set(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "set()"


def test_generate_defaults_are_the_dataclass_defaults() -> None:
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.sampling import Sampling
    from kvstore.cli.main import _parser

    args = _parser().parse_args(["generate", "question"])
    sampling = Sampling()
    assert (args.max_tokens, args.temperature, args.top_p, args.seed, tuple(args.stop)) == (
        sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed, sampling.stop,
    )  # fmt: skip
    assert args.namespace == inspect.signature(Engine).parameters["namespace"].default
    assert args.budget == 1.0


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ([], {"KVSIEVE_MAX_CALLS": "1"}, "more than 1 gen/select calls (max_calls)"),
        (["--max-calls", "1"], {"KVSIEVE_MAX_CALLS": "64"}, "more than 1 gen/select calls (max_calls)"),
        (["--max-calls", "1"], {"KVSIEVE_MAX_CALLS": "abc"}, "more than 1 gen/select calls"),  # flag wins
        ([], {"KVSIEVE_MAX_TOTAL_TOKENS": "3"}, "total max_tokens exceeds 3 (max_total_tokens)"),
        ([], {"KVSIEVE_MAX_CALLS": "abc"}, "KVSIEVE_MAX_CALLS='abc': max_calls: cannot read 'abc'"),
        (["--max-fork-depth", "two"], {}, "--max-fork-depth='two': max_fork_depth: cannot read"),
        (["--deadline-s", "0"], {}, "--deadline-s='0': deadline_s must be > 0"),
        (
            [],
            {"KVSIEVE_MAX_SOURCE_BYTES": "-5"},
            "KVSIEVE_MAX_SOURCE_BYTES='-5': max_source_bytes must be > 0",
        ),
    ],
)
def test_dsl_limits_come_from_flags_and_environment(
    tmp_path: Path, flags: list[str], env: dict[str, str], message: str
) -> None:
    program = tmp_path / "two.kvs"
    program.write_text(PROGRAM)
    result = kvsieve("run", str(program), "--data-dir", str(tmp_path / "data"), *flags, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("kvsieve run: error: ") and message in result.stderr, result.stderr
    assert not (tmp_path / "data").exists()  # refused before the model or the store was opened


def test_engine_help_shows_the_engine_defaults_not_the_sidecars() -> None:
    from engine_adapter.server import DEFAULT_LISTEN
    from kvstore.server.config import ServerConfig

    result = kvsieve("engine", "--help")
    assert result.returncode == 0 and f"(default: {DEFAULT_LISTEN})" in " ".join(result.stdout.split())
    assert f"(default: {ServerConfig().listen})" not in " ".join(result.stdout.split())


@pytest.mark.model
@pytest.mark.slow
def test_a_limit_from_the_environment_reaches_the_executor(tmp_path: Path) -> None:
    """deadline_s is checked while the program runs, not by the planner."""
    program = tmp_path / "two.kvs"
    program.write_text(PROGRAM)
    result = kvsieve(
        "run", str(program), "--data-dir", str(tmp_path / "data"), env={"KVSIEVE_DEADLINE_S": "0.001"}
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "kvsieve run: error: deadline of 0.001 s exceeded" in result.stderr, result.stderr
