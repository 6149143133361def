"""Branch contexts: token history plus KV cache (decoding branches keep theirs in the run's batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine_adapter.runner import Conversation, share_cache


@dataclass
class Context:
    """One branch's conversation: computed tokens (in `cache`) and tokens still to compute."""

    tokens: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    cache: Any = None
    logits: torch.Tensor | None = None  # of the last computed token
    conversation: Conversation = field(default_factory=Conversation)  # its messages, for the chat template

    @property
    def next_position(self) -> int:
        """Position of the next token to compute."""
        return len(self.tokens)

    def fork(self, config: Any) -> Context:
        """A child context on the same computed tokens, sharing their KV tensors (copy on write)."""
        return Context(
            list(self.tokens), [], share_cache(self.cache, config), self.logits, self.conversation.copy()
        )
