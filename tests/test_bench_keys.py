"""Every system benchmark runs small (--quick) and prints its published keys."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PUBLISHED = {
    "transfer": "grpc_stream_mb_s shm_mb_s raw_tcp_mb_s memcpy_mb_s grpc_vs_tcp shm_vs_memcpy "
    "lookup_p50_us lookup_p99_us",
    "ttft": "ttft_speedup_disk_2048 ttft_speedup_budget_2048 top1_budget_0_25 kl_budget_0_25 stats_overhead",
    "readamp": "read_amp_importance_0_25 read_amp_natural_0_25 top1_importance_0_25 kl_importance_0_25 "
    "top1_sink_recent_0_25 top1_random_0_25 read_amp_importance_0_1 read_amp_natural_0_5 "
    "top1_importance_0_1 top1_sink_recent_0_5 top1_random_0_5 kl_importance_0_5",
    "vllm": "ttft_recompute_s ttft_prefix_cache_s ttft_example_connector_s ttft_kvsieve_restart_s "
    "speedup_restart_vs_recompute kvsieve_vs_example_connector kvsieve_vs_prefix_cache",
}
# "vllm" is not run here: even --quick starts vLLM four times (minutes), past CI's budget for
# the vLLM integration; tests/test_vllm.py covers the connector, the figures are in docs/performance.md.


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "transfer",
        pytest.param("ttft", marks=pytest.mark.model),
        pytest.param("readamp", marks=pytest.mark.model),
    ],
)
def test_benchmark_prints_its_published_keys(name: str) -> None:
    cmd = [sys.executable, "-m", "kvstore.cli", "bench", name, "--json", "--quick"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    missing = [key for key in PUBLISHED[name].split() if key not in figures]
    assert not missing
    assert all(isinstance(figures[key], int | float) for key in PUBLISHED[name].split())
