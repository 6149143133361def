"""The quality benchmark's simulated partial loads equal real partial caches (bench/quality/masking.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from bench.common.texts import token_windows
from bench.quality.masking import MaskPlan, masking
from bench.quality.methods import QAConfig, chooser
from bench.quality.quality_bench import forward, prefix_state
from importance.summaries import FixedBudget

pytestmark = [pytest.mark.model]
PREFIX, NEW = 96, 12


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True)


@pytest.fixture(scope="module")
def prefix(lm: Any) -> tuple[list[int], list[int], list[Any], Any]:
    ids = token_windows(lm.tokenizer, PREFIX + NEW, 1)[0][1]
    with torch.inference_mode():
        pairs, state = prefix_state(lm, ids[:PREFIX])
    return ids[:PREFIX], ids[PREFIX:], pairs, state


def partial_cache_logits(lm: Any, pairs: list[Any], kept: np.ndarray, new: list[int]) -> torch.Tensor:
    """A real DynamicCache holding only the kept tokens, the new ones at their true positions."""
    from engine_adapter.runner.cache import cache_from

    index = torch.from_numpy(np.flatnonzero(kept))
    cache = cache_from(lm.model.config, [(k[:, :, index], v[:, :, index]) for k, v in pairs])
    positions = torch.arange(PREFIX, PREFIX + len(new)).unsqueeze(0)
    out = lm.model(
        input_ids=torch.tensor([new]), position_ids=positions, past_key_values=cache, use_cache=True
    )
    assert cache.get_seq_length() == len(index) + len(new)  # the partial cache really is partial
    return out.logits[0].float()


def test_masking_equals_a_real_partial_cache(lm: Any, prefix: Any) -> None:
    _, new, pairs, _ = prefix
    keep = np.zeros(PREFIX, dtype=bool)
    keep[[0, 1, 2, 3, *range(32, 48), *range(80, 96)]] = True  # sinks and two chunks, layer-uniform
    plan = MaskPlan(PREFIX, 1, lambda layer, queries: keep[None])
    with masking(lm.model), torch.inference_mode():
        masked = forward(lm, pairs, new, [plan])[0]
        real = partial_cache_logits(lm, pairs, keep, new)
        full = forward(lm, pairs, new, [None])[0]
    assert len(plan.kept) == lm.spec.num_layers and plan.delivered_tokens_fraction() == keep.mean()
    assert (masked - real).abs().max() < 1e-4
    assert (masked - full).abs().max() > 1e-2  # the selection matters: the check above can fail


def test_a_static_selection_equals_a_real_partial_cache(lm: Any, prefix: Any) -> None:
    _, new, pairs, state = prefix
    plan = MaskPlan(PREFIX, 1, chooser("static", state, FixedBudget(0.25), QAConfig()))
    with masking(lm.model), torch.inference_mode():
        masked = forward(lm, pairs, new, [plan])[0]
        real = partial_cache_logits(lm, pairs, plan.kept[0][0], new)
    assert plan.kept[0].sum() == PREFIX // 4
    assert (masked - real).abs().max() < 1e-4


@pytest.mark.parametrize(
    "method",
    ["static", "static_c8", "static_c8_edges", "sink_recent", "snapkv", "qa_lowbit2", "qa_minmax", "oracle"],
)
def test_budget_one_is_the_full_prefix(lm: Any, prefix: Any, method: str) -> None:
    _, new, pairs, state = prefix
    plan = MaskPlan(PREFIX, 4, chooser(method, state, FixedBudget(1.0), QAConfig()))
    with masking(lm.model), torch.inference_mode():
        masked = forward(lm, pairs, new, [plan])[0]
        full = forward(lm, pairs, new, [None])[0]
    assert all(k.all() for k in plan.kept.values())
    assert (masked - full).abs().max() < 1e-4


def test_batched_rows_run_their_own_selection(lm: Any, prefix: Any) -> None:
    _, new, pairs, state = prefix
    methods = ["sink_recent", "qa_lowbit2", "oracle"]
    with masking(lm.model), torch.inference_mode():
        plans = [MaskPlan(PREFIX, 4, chooser(m, state, FixedBudget(0.25), QAConfig())) for m in methods]
        batched = forward(lm, pairs, new, list(plans))
        alone = [forward(lm, pairs, new, [MaskPlan(PREFIX, 4, p.choose)])[0] for p in plans]
    # float32 noise only: logits reach ~20 and a batch of 3 runs other matmul kernels than a
    # batch of 1 (2e-4 seen); a row that ran another row's selection differs by far more
    for row, single in zip(batched, alone, strict=True):
        assert (row - single).abs().max() < 1e-3
    assert (batched[0] - batched[1]).abs().max() > 1e-2


def test_per_kv_head_rows_map_to_their_query_heads(lm: Any, prefix: Any) -> None:
    _, new, pairs, _ = prefix
    keep = np.zeros(PREFIX, dtype=bool)
    keep[::3] = True
    heads = lm.spec.num_kv_heads
    with masking(lm.model), torch.inference_mode():
        uniform = forward(lm, pairs, new, [MaskPlan(PREFIX, 1, lambda layer, q: keep[None])])[0]
        per_head = forward(
            lm, pairs, new, [MaskPlan(PREFIX, 1, lambda layer, q: np.repeat(keep[None], heads, 0))]
        )[0]
        only_first = np.ones((heads, PREFIX), dtype=bool)
        only_first[0] = keep
        first = forward(lm, pairs, new, [MaskPlan(PREFIX, 1, lambda layer, q: only_first)])[0]
    assert (uniform - per_head).abs().max() < 1e-5
    assert (first - uniform).abs().max() > 1e-3  # the other KV heads saw everything


def test_the_chooser_sees_the_layers_real_queries(lm: Any, prefix: Any) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    _, new, pairs, _ = prefix
    seen: dict[int, np.ndarray] = {}

    def record(layer: int, queries: np.ndarray) -> np.ndarray:
        seen[layer] = queries
        return np.ones((1, PREFIX), dtype=bool)

    model = lm.model.model
    positions = torch.arange(PREFIX, PREFIX + len(new)).unsqueeze(0)
    with masking(lm.model), torch.inference_mode():
        forward(lm, pairs, new, [MaskPlan(PREFIX, 5, record)])
        hidden = _hidden_states(lm, pairs, new)
        layer = model.layers[7]
        attn = layer.self_attn
        normed = layer.input_layernorm(hidden[7][:, :5])
        q = attn.q_proj(normed).view(1, 5, -1, attn.head_dim).transpose(1, 2)
        cos, sin = model.rotary_emb(normed, positions[:, :5])
        expected, _ = apply_rotary_pos_emb(q, q, cos, sin)
    assert sorted(seen) == list(range(lm.spec.num_layers))
    assert np.allclose(seen[7], expected[0].numpy(), atol=1e-4)


def _hidden_states(lm: Any, pairs: list[Any], new: list[int]) -> Any:
    from engine_adapter.runner.cache import cache_from

    cache = cache_from(lm.model.config, pairs)
    positions = torch.arange(PREFIX, PREFIX + len(new)).unsqueeze(0)
    out = lm.model(input_ids=torch.tensor([new]), position_ids=positions, past_key_values=cache,
                   use_cache=True, output_hidden_states=True)  # fmt: skip
    return out.hidden_states
