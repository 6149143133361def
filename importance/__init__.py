"""Token importance: scorers, block layout and chunk selection. No torch or model code."""

from importance.layout import BlockSelection, budget_to_tokens, importance_order, select_chunks

__all__ = ["BlockSelection", "budget_to_tokens", "importance_order", "select_chunks"]
