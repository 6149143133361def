"""Every system benchmark runs small (--quick) and prints its published keys."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
from conftest import require_extra, require_redis_server

PUBLISHED = {
    "transfer": "grpc_stream_mb_s shm_mb_s raw_tcp_mb_s memcpy_mb_s grpc_vs_tcp shm_vs_memcpy "
    "lookup_p50_us lookup_p99_us lookup_p50_ms lookup_p99_ms store_grpc_mb_s store_shm_mb_s "
    "store_shm_vs_grpc grpc_floor_mb_s grpc_vs_floor unary_floor_p50_ms unary_floor_p99_ms "
    "lookup_vs_unary_floor store_shm_ack_mb_s store_shm_write_behind_mb_s store_shm_sync_mb_s "
    "store_shm_vs_sync write_behind_mb_s sequential_write_mb_s write_behind_vs_sequential_write "
    "restart_fetch_s restart_fetch_pread_s restart_fetch_memcpy_s restart_fetch_vs_pread "
    "restart_fetch_vs_memcpy restart_fetch_cache_drops",
    "ttft": "ttft_speedup_disk_2048 ttft_speedup_budget_2048 top1_budget_0_25 kl_budget_0_25 stats_overhead "
    "floor_s ttft_vs_floor ttft_speedup_layered_2048 cold_read_vs_disk cold_read_vs_disk_layered",
    "readamp": "read_amp_importance_0_25 read_amp_natural_0_25 top1_importance_0_25 kl_importance_0_25 "
    "top1_sink_recent_0_25 top1_random_0_25 read_amp_importance_0_1 read_amp_natural_0_5 "
    "top1_importance_0_1 top1_sink_recent_0_5 top1_random_0_5 kl_importance_0_5 "
    "delivered_fraction_0_1 delivered_fraction_0_25 delivered_fraction_0_5 delivered_fraction_auto "
    "read_fraction_0_25 estimated_coverage_auto top1_importance_auto",
    "radix": "match_us_kvsieve insert_us_kvsieve bytes_per_block_kvsieve",
    "chaos": "server_kills client_kills flips_injected loads_checked wrong_kv server_crashes_unplanned "
    "leaked_segments layered_loads_checked wrong_kv_layered",
    "remote": "remote_load_mb_s redis_get_mb_s remote_vs_get store_ms_write_behind store_ms_sync "
    "ttft_speedup_remote_vs_recompute",
    "quality": " ".join(
        f"{figure}_{method}_{tag}"
        for figure in (
            "delivered_fraction",
            "top1",
            "kl",
            "answer_top1",
            "answer_kl",
            "first_token",
            "exact_match",
        )
        for method in (
            *("static", "static_c8", "static_c8_edges"),
            *("sink_recent", "snapkv", "qa_minmax", "qa_mean", "qa_lowbit2", "oracle"),
        )
        for tag in ("0_1", "0_25", "0_5", "auto")
    )
    + " summary_bytes_fraction summary_bytes_fraction_minmax summary_bytes_fraction_mean "
    "summary_bytes_fraction_lowbit2",
    "layers": "qa_host_ms_per_layer qa_host_ms_per_layer_summaries qa_host_ms_per_layer_choice "
    "qa_host_ms_per_layer_reads qa_read_fraction qa_cold_read_vs_disk qa_read_vs_full_read_cold "
    "disk_seq_read_mb_s",
    "layout": "store_mb_s_importance store_mb_s_layered cold_full_mb_s_importance cold_full_mb_s_layered "
    "warm_full_mb_s_importance warm_full_mb_s_layered warm_0_25_ms_importance warm_0_25_ms_layered "
    "layered_vs_importance_cold layered_vs_importance_warm layer_read_0_25_ms layered_block_bytes_ratio",
    "sglang": "",  # every figure needs SGLang: see PEER_KEYS
    # --quick measures 1,024 tokens only; full runs add _4096_ and _8192_ (docs/importance.md)
    "longdoc": " ".join(
        f"{figure}_{method}_1024_{tag}"
        for figure in ("answer_top1", "answer_kl", "first_token", "top1", "read_fraction")
        for method in ("engine", "static")
        for tag in ("0_1", "0_25")
    )
    + " layered_path_engine_1024_0_25 topup_fraction_engine_1024_0_25",
    "gpu": "cuda_available cpu_bare_copy_gb_s cpu_staged_copy_gb_s cpu_staged_vs_bare "
    "cpu_pool_allocations_after_warmup cpu_seq_split_cold_vs_best_tiny_512 "
    "cpu_seq_split_warm_vs_best_tiny_512 cpu_seq_split_cold_first_vs_best_tiny_512 "
    "cpu_seq_qa25_auto_warm_vs_full_tiny_512 cpu_store_inline_s_512 cpu_store_inline_vs_prefill_512 "
    "cpu_store_vs_prefill_512",
    "vllm": "ttft_recompute_s ttft_prefix_cache_s ttft_example_connector_s ttft_kvsieve_restart_s "
    "speedup_restart_vs_recompute kvsieve_vs_example_connector kvsieve_vs_prefix_cache "
    "ttft_kvsieve_miss_s miss_overhead first_token_mismatches ttft_kvsieve_warm_s "
    "kvsieve_warm_vs_prefix_cache hit_lookup_s hit_fetch_s hit_copy_s hit_vllm_s warm_fetch_s "
    "miss_lookup_s miss_save_copy_s miss_vllm_s miss_store_s example_connector_loads_verified "
    "page_cache_drops",
    "events": "events_lost store_throughput_events_vs_off store_throughput_events_vs_off_disk "
    "store_p50_replay_flood_vs_quiet store_p50_after_replay_flood_vs_quiet replay_flood_refused",
}
# A peer's keys exist only where the peer can run (SGLang: bench/sglang/setup_sglang.sh);
# otherwise the first key, a string, says why, and none of the peer's keys is printed.
PEER_KEYS = {
    "radix": (
        "sglang_unavailable",
        "match_us_sglang insert_us_sglang bytes_per_block_sglang radix_speedup_vs_sglang",
    ),
    # On a GPU only (issue #25); the quick run times N = 1024 tokens.
    "gpu": (
        "cuda_unavailable",
        "h2d_gb_s h2d_vs_pinned_floor overlap_hidden_fraction ttft_gpu_recompute_s_1024 "
        "ttft_gpu_load_s_1024 ttft_gpu_recompute_s_smol_1024 ttft_gpu_load_s_smol_1024 "
        "h2d_staged_vs_pinned_floor h2d_tier_gb_s e2e_recompute_s_1024 e2e_full_warm_vs_recompute_1024 "
        "e2e_full_cold_vs_recompute_1024 e2e_cold_read_vs_disk_1024 e2e_qa25_cold_vs_full_1024 "
        "e2e_qa25_warm_vs_full_1024 e2e_store_vs_prefill_1024 e2e_full_warm_vs_recompute_smol_1024 "
        "e2e_qa25_cold_vs_recompute_1024 e2e_qa25_speculation_hit_rate_1024 "
        "e2e_split_cold_again_vs_best_1024 seq_split_cold_vs_best_1024 seq_split_warm_vs_best_smol_1024",
    ),
    "sglang": (
        "sglang_unavailable",
        "roundtrip_exact wrong_pages batch_get_v1_vs_shm_load batch_set_v1_vs_shm_store "
        "batch_exists_128_vs_lookup",
    ),
    # Dynamo's standalone indexer reads the sidecar's KV events (bench/events/setup_dynamo.sh).
    "events": (
        "dynamo_unavailable",
        "indexer_matched_fraction stale_after_removal restart_view_equal event_lag_p99_ms",
    ),
}
#: What a benchmark needs beyond the README's install: it is skipped without it (or fails under
#: the KVSIEVE_REQUIRE_* variable .ci/run sets).
NEEDS = {"events": lambda: require_extra("events"), "remote": require_redis_server}
# "vllm" is not run here: even --quick starts vLLM four times (minutes), past CI's budget for
# the vLLM integration; tests/test_vllm.py covers the connector, the figures are in docs/performance.md.
# `kvsieve bench vllm --concurrency C` adds these (bench/vllm/concurrency.py), checked below on its summary.
VLLM_LOAD_KEYS = (
    "throughput_kvsieve_vs_plain p99_ttft_kvsieve_vs_prefix_cache p99_ttft_kvsieve_vs_prefix_cache_small "
    "throughput_kvsieve_vs_prefix_cache_small throughput_rps_plain throughput_rps_prefix_cache "
    "throughput_rps_kvsieve ttft_p50_s_kvsieve ttft_p99_s_kvsieve ttft_p99_s_prefix_cache "
    "prompt_tokens_per_s_kvsieve load_first_token_mismatches"
)


def test_vllm_load_summary_has_its_published_keys() -> None:
    from bench.vllm.concurrency import MODES, summarize

    runs = {m: {"outputs": [[5]], "ttft_s": [0.5 + i], "elapsed_s": 1.0 + i} for i, m in enumerate(MODES)}
    figures = summarize(runs, [[1, 2, 3]], concurrency=1)
    assert [key for key in VLLM_LOAD_KEYS.split() if key not in figures] == []
    assert all(isinstance(figures[key], int | float) for key in VLLM_LOAD_KEYS.split())


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "transfer",
        "chaos",
        pytest.param("ttft", marks=pytest.mark.model),
        pytest.param("readamp", marks=pytest.mark.model),
        pytest.param("quality", marks=pytest.mark.model),
        pytest.param("longdoc", marks=pytest.mark.model),
        "radix",
        "sglang",
        "layout",
        "layers",
        "gpu",
        pytest.param("events", marks=pytest.mark.events),
        pytest.param("remote", marks=[pytest.mark.model, pytest.mark.redis]),
    ],
)
def test_benchmark_prints_its_published_keys(name: str) -> None:
    if name in NEEDS:
        NEEDS[name]()
    cmd = [sys.executable, "-m", "kvstore.cli.main", "bench", name, "--json", "--quick"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    missing = [key for key in PUBLISHED[name].split() if key not in figures]
    assert not missing
    assert all(isinstance(figures[key], int | float) for key in PUBLISHED[name].split())
    if name in PEER_KEYS:
        _check_peer_keys(name, figures, *PEER_KEYS[name])


def _check_peer_keys(name: str, figures: dict[str, object], reason_key: str, keys: str) -> None:
    """All the peer's figures, or none of them and a stated reason (shown as a warning)."""
    if reason_key in figures:
        reason = figures[reason_key]
        assert isinstance(reason, str) and reason
        assert not [key for key in keys.split() if key in figures]
        warnings.warn(f"bench {name}: peer not measured: {reason}", stacklevel=2)
    else:
        assert all(isinstance(figures[key], int | float) for key in keys.split())
