"""Left-padded batches: one helper for the engine's prompts and the DSL's branches."""

from __future__ import annotations

import numpy as np
import torch

from engine_adapter.runner.batch import left_pad, padding_mask


def test_rows_are_right_aligned_after_their_padding() -> None:
    rows = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    batch = left_pad(rows, dim=0, fill=-1)
    assert batch.tolist() == [[5, 6, 7], [-1, -1, 8]]
    assert not np.shares_memory(batch.numpy(), rows[0].numpy())  # copied, so a row can change freely


def test_kv_rows_pad_along_the_sequence_axis() -> None:
    keys = [torch.ones(2, 3, 4), torch.full((2, 1, 4), 2.0)]  # (heads, tokens, head_dim)
    batch = left_pad(keys, dim=1)
    assert batch.shape == (2, 2, 3, 4)
    assert batch[1, :, :2].abs().sum() == 0 and bool((batch[1, :, 2] == 2).all())


def test_the_mask_covers_each_rows_tokens_and_the_new_ones() -> None:
    assert padding_mask([3, 1], device="cpu").tolist() == [[1, 1, 1], [0, 0, 1]]
    assert padding_mask([3, 1], extra=1, device="cpu").tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
