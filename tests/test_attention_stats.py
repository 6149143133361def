"""`AttentionStats`: the prefill and history scores, kept on the attention's device until read.

The scores are checked against their definition in numpy; that they never leave the device
before they are read is checked with weights on the `meta` device, which has no data to copy:
`observe` must run there (one host copy per layer, as main made, fails it), and the first read,
the one deliberate copy to the host, is where it fails. On a GPU the scores equal the CPU's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine_adapter.runner.attention import AttentionStats, _causal_mask

PREFIX, NEW, LAYERS, HEADS = 5, 4, 3, 2


def _weights(seed: int) -> torch.Tensor:
    """Causal attention weights (1, heads, NEW queries, PREFIX + NEW keys), rows summing to 1."""
    scores = torch.randn(1, HEADS, NEW, PREFIX + NEW, generator=torch.Generator().manual_seed(seed))
    future = torch.ones(NEW, PREFIX + NEW).triu(PREFIX + 1).bool()
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1)


def _reference(weights: list[torch.Tensor]) -> dict[str, np.ndarray[Any, Any]]:
    """The scores by their definition, layer by layer in numpy, then averaged over layers."""
    raw, prefill, history = [], [], []
    for w in weights:
        a = w[0].double().numpy().mean(axis=0)  # (queries, keys)
        mass = a[:, PREFIX:].sum(axis=0)
        raw.append(mass)
        prefill.append(mass / np.arange(NEW, 0, -1))  # key j is seen by the NEW - j queries from j on
        prefix = a[:, :PREFIX]
        history.append((prefix / prefix.sum(axis=1, keepdims=True)).mean(axis=0))
    means = (np.mean(raw, axis=0), np.mean(prefill, axis=0), np.mean(history, axis=0))
    return dict(zip(("raw", "prefill", "history"), means, strict=True))


def _observed(weights: list[torch.Tensor]) -> AttentionStats:
    stats = AttentionStats(PREFIX, LAYERS)
    for layer, w in enumerate(weights):
        stats.observe(layer, w)
    return stats


def test_scores_follow_their_definition_averaged_over_layers() -> None:
    weights = [_weights(seed) for seed in range(LAYERS)]
    stats, expected = _observed(weights), _reference(weights)
    np.testing.assert_allclose(stats.prefill_raw, expected["raw"], rtol=1e-5)
    np.testing.assert_allclose(stats.prefill, expected["prefill"], rtol=1e-5)
    np.testing.assert_allclose(stats.history, expected["history"], rtol=1e-5)
    assert stats.prefill.dtype == stats.history.dtype == np.float32
    assert stats.prefill.shape == (NEW,) and stats.history.shape == (PREFIX,)


def test_nothing_observed_reads_as_empty_and_no_prefix_as_no_history() -> None:
    assert AttentionStats(0, LAYERS).prefill.shape == (0,)
    stats = AttentionStats(0, 1)
    stats.observe(0, torch.full((1, 1, 3, 3), 1 / 3).tril())
    assert stats.history.shape == (0,) and stats.prefill.shape == (3,)


def test_observing_stays_on_the_device_and_reading_is_the_one_copy() -> None:
    stats = _observed([_weights(seed).to("meta") for seed in range(LAYERS)])  # no data: no copy possible
    with pytest.raises((NotImplementedError, RuntimeError)):
        stats.prefill  # noqa: B018 (the read is the copy)


def test_the_causal_mask_is_made_where_the_scores_are() -> None:
    like = torch.zeros(1, device="meta")
    assert _causal_mask(None, 2, 5, like).device.type == "meta"
    mask = _causal_mask(None, 2, 5, torch.zeros(1))
    assert torch.isinf(mask).tolist() == [[False, False, False, False, True], [False] * 5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_scores_equal_the_cpus() -> None:
    weights = [_weights(seed) for seed in range(LAYERS)]
    on_cpu, on_gpu = _observed(weights), _observed([w.cuda() for w in weights])
    for name in ("prefill", "prefill_raw", "history"):
        np.testing.assert_allclose(getattr(on_gpu, name), getattr(on_cpu, name), rtol=1e-5, atol=1e-7)
