"""`kvsieve bench NAME`: the explicit table of benchmarks (bench/commands.py), checked against the
tree without importing any benchmark."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import kvsieve

from bench.commands import BENCHMARKS, DTYPED, PLOTTED

ROOT = Path(__file__).resolve().parent.parent
#: Every name `kvsieve bench` took when each benchmark was `bench/NAME_bench.py`: none may go.
NAMES = (
    "chaos dsl events gpu layers layout longdoc quality radix readamp remote sglang store transfer ttft vllm"
)


def _source(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


def test_every_name_of_before_is_still_a_benchmark() -> None:
    assert sorted(BENCHMARKS) == NAMES.split()


def test_every_name_is_a_module_named_after_it_that_has_run() -> None:
    for name, module in BENCHMARKS.items():
        assert module.startswith("bench.") and module.endswith(f".{name}_bench"), module
        assert _source(module).is_file(), f"{name}: no {_source(module)}"
        assert "run" in _functions(_source(module)), f"{module} has no run()"


def test_every_bench_module_has_a_name() -> None:
    """A `*_bench.py` module the table does not name would be a benchmark no command runs."""
    found = (ROOT / "bench").rglob("*_bench.py")
    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts) for path in found}
    assert modules == set(BENCHMARKS.values())


def test_every_plotted_benchmark_has_its_plot() -> None:
    assert set(PLOTTED) <= set(BENCHMARKS)
    plots = _functions(ROOT / "bench" / "common" / "plots.py")
    assert [name for name in PLOTTED if f"plot_{name}" not in plots] == []


def test_parsing_a_bench_command_imports_no_benchmark() -> None:
    code = (
        "import sys, kvstore.cli.main as c\n"
        "c._parser().parse_args(['bench', 'ttft', '--quick'])\n"
        "print(sorted(m for m in sys.modules if m.startswith('bench.') and m != 'bench.commands'"
        " or m in ('torch', 'grpc')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_plot_is_refused_before_a_benchmark_without_one_runs(tmp_path: Path) -> None:
    result = kvsieve("bench", "store", "--plot", str(tmp_path / "store.png"))
    assert result.returncode == 2 and "--plot draws ttft, readamp, quality, longdoc only" in result.stderr
    assert not (tmp_path / "store.png").exists()


def test_dtype_is_refused_where_no_model_runs_and_taken_where_one_does() -> None:
    result = kvsieve("bench", "store", "--dtype", "bfloat16")
    assert result.returncode == 2 and "--dtype applies to gpu only, not 'store'" in result.stderr
    for name in DTYPED:
        assert "dtype" in _signature_of_run(_source(BENCHMARKS[name]))


def _signature_of_run(path: Path) -> set[str]:
    run = next(
        n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "run"
    )
    return {a.arg for a in run.args.args}
