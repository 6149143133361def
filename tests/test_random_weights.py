"""The `real_weights` marker (tests/conftest.py): under the GPU kit's random weights
(KVSIEVE_RANDOM_WEIGHTS=1) a test that asserts the real model's answers skips, saying why, before
its fixtures load anything; without the variable it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REAL_WEIGHTS_REASON

ROOT = Path(__file__).resolve().parent.parent
#: A test that asserts the real model's answer (it names Paris).
ANSWER_TEST = "tests/test_dsl_run.py::test_chatbot_example"


def _pytest(*args: str, random_weights: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSIEVE_RANDOM_WEIGHTS"}
    if random_weights:
        env["KVSIEVE_RANDOM_WEIGHTS"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def test_an_answer_test_skips_with_the_reason_under_random_weights() -> None:
    result = _pytest(ANSWER_TEST, random_weights=True)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "1 skipped" in result.stdout and REAL_WEIGHTS_REASON in result.stdout


def test_without_random_weights_the_marked_tests_are_collected_to_run() -> None:
    result = _pytest(
        "-m", "real_weights", "--collect-only", "-q", ANSWER_TEST.split("::")[0], random_weights=False
    )
    assert result.returncode == 0, result.stdout[-2000:]
    assert ANSWER_TEST in result.stdout
