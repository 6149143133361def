"""`kvsieve generate --budget auto [--coverage C] -v`: bad budgets are refused before the model
loads; a budgeted second run says what it really delivered and read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import RANDOM_WEIGHTS, kvsieve

PRIMER = Path(__file__).parent.parent / "examples" / "kv-cache-primer.txt"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--budget", "most"], "got 'most'"),
        (["--budget", "1.5"], "got 1.5"),
        (["--budget", "auto", "--coverage", "0"], "coverage must be a fraction in (0, 1], got '0'"),
        (["--budget", "0.5", "--coverage", "0.9"], "coverage applies only to budget='auto'"),
    ],
)
def test_bad_budget_flags_are_refused_before_the_model_loads(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    result = kvsieve("generate", "Q?", "--data-dir", str(tmp_path / "data"), *flags)
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.model
def test_verbose_generate_reports_the_delivered_fraction(tmp_path: Path) -> None:
    args = ["generate", "--context", str(PRIMER), "What is attention?", "-v", "--max-tokens", "2"]
    args += ["--data-dir", str(tmp_path / "data")]
    assert kvsieve(*args, timeout=600).returncode == 0
    # the default (layered) layout: a fraction is query-aware, layer by layer (summaries counted)
    second = kvsieve(*args, "--budget", "0.25", timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    line = re.search(r"layer by layer: .* chosen by the queries of the last \d+ of \d+ new tokens; "
                     r"delivered ([\d.]+)% of the cached prefix's tokens, read ([\d.]+)% of its bytes "
                     r"\(summaries ([\d.]+)%", second.stderr)  # fmt: skip
    assert line is not None, second.stderr
    delivered, read, summaries = (float(line.group(i)) for i in (1, 2, 3))
    # Random weights' answers top nothing up (no chunk passes theta): their delivered share lacks it.
    assert RANDOM_WEIGHTS or delivered >= 15.0
    assert delivered < 25.0 and read <= 26.6 and 5.0 < summaries < 8.0
    # auto: the store's coverage plan says how much, the queries which
    third = kvsieve(*args, "--budget", "auto", "--coverage", "0.5", timeout=600)
    assert third.returncode == 0, third.stderr[-2000:]
    assert "loaded (budget auto (coverage 0.5))" in third.stderr
    assert re.search(r"layer by layer: .* delivered [\d.]+% of the cached prefix's tokens", third.stderr)
    # the importance layout: the static order, reported as a budget's delivery
    importance = [*args[:-2], "--data-dir", str(tmp_path / "importance")]
    env = {"KVSIEVE_LAYOUT": "importance"}
    assert kvsieve(*importance, timeout=600, env=env).returncode == 0
    for flags, low, high in [
        (["--budget", "0.25"], 25.0, 26.6),
        (["--budget", "auto", "--coverage", "0.5"], 10, 100),
    ]:
        second = kvsieve(*importance, *flags, timeout=600, env=env)
        assert second.returncode == 0, second.stderr[-2000:]
        line = re.search(r"budget (.*): delivered ([\d.]+)% of .* read ([\d.]+)% of its bytes, "
                         r"estimated attention mass ([\d.]+)%", second.stderr)  # fmt: skip
        assert line is not None, second.stderr
        assert low <= float(line.group(2)) <= high and float(line.group(3)) > 0
        if "auto" in flags:
            assert line.group(1) == "auto (coverage 0.5)" and float(line.group(4)) >= 50.0
