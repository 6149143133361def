"""Decoding one answer: choosing its tokens, growing its text, and knowing when it ends.

Written once for every caller (`Engine.generate`, `Engine.generate_batch`, the DSL's
`gen`). The text grows incrementally: a new token costs at most two tokenizer decode
calls, each over a window of a few tokens, and stop strings are searched only in the
new text plus the last max(len(stop)) - 1 characters before it. A whole answer therefore
costs time linear in its length (re-decoding and re-searching the whole answer at every
token, as before, was quadratic).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from engine_adapter.runner.sampling import Sampling

#: What a decode returns in place of bytes that do not form a whole character (yet).
_INCOMPLETE = "\ufffd"


class Sampler:
    """Chooses next tokens under one request's `Sampling`, with its own seeded generator.

    With `sampling.no_repeat_ngram` it also remembers, per row, the tokens it chose, and
    never chooses one that would repeat an n-gram of them (`NoRepeatNgram`): one sampler
    per answer (or per batch of answers, a row each).
    """

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self.generator = torch.Generator()
        # Unseeded: a fresh random seed (a greedy sampler never draws from it).
        self.generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        self._guards: list[NoRepeatNgram] = []

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of `logits` (batch, vocab)."""
        if self.sampling.no_repeat_ngram:
            logits = self._ban_repeats(logits)
        chosen = self._choose(logits)
        for guard, token in zip(self._guards, chosen.tolist(), strict=False):
            guard.add(int(token))
        return chosen

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        sampling = self.sampling
        if sampling.temperature == 0.0:
            return logits.argmax(dim=-1)
        # Drawn on the CPU, where the seeded generator is (same seed, same answer on any device).
        probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            keep = sorted_probs.cumsum(dim=-1) - sorted_probs < sampling.top_p  # always keeps the top token
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1).to(logits.device)

    def _ban_repeats(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with each row's repeating tokens at -inf (a copy; the caller's is untouched)."""
        while len(self._guards) < logits.shape[0]:
            self._guards.append(NoRepeatNgram(self.sampling.no_repeat_ngram))
        banned = [(row, sorted(guard.banned())) for row, guard in enumerate(self._guards)]
        if not any(tokens for _, tokens in banned):
            return logits
        logits = logits.clone()
        for row, tokens in banned:
            if tokens:
                logits[row, tokens] = float("-inf")
        return logits


class NoRepeatNgram:
    """The repetition guard of one answer: which next tokens would repeat an n-gram of it.

    Only the answer's own tokens count (an answer may quote its prompt). Kept
    incrementally, a dict from each (n-1)-token run to the tokens seen after it, so a
    token costs O(n) however long the answer grows.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self._followers: dict[tuple[int, ...], set[int]] = {}

    def add(self, token: int) -> None:
        """Record the answer's next token."""
        self.tokens.append(token)
        if len(self.tokens) >= self.n:
            run = tuple(self.tokens[len(self.tokens) - self.n : -1])
            self._followers.setdefault(run, set()).add(token)

    def banned(self) -> set[int]:
        """Tokens that would end a run of n tokens already in the answer."""
        if len(self.tokens) < self.n - 1:
            return set()
        return self._followers.get(tuple(self.tokens[len(self.tokens) - self.n + 1 :]), set())


class IncrementalText:
    """The text of a growing token sequence, decoding only a window at its end.

    The window starts where the text last became stable (complete characters):
    `tokens[prefix:read]` is already counted, `tokens[read:]` is `pending`. Decoding
    from `prefix` rather than `read` keeps tokenizers that drop a window's leading
    space right; a window that ends in U+FFFD is a character whose bytes are still
    arriving, so it stays pending. Joined, the stable pieces and `pending` equal
    `tokenizer.decode(tokens, skip_special_tokens=True)` (tests/test_decode.py).
    A window spans the last stable piece and the pending tokens: a few tokens for
    any valid UTF-8 text. Only bytes that never complete a character (invalid
    UTF-8 from the model) keep it growing until a whole character follows.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = self._read = 0
        self._prefix_text = ""
        self._stable: list[str] = []
        self.pending = ""

    def add(self, token: int) -> str:
        """Append a token; returns the text that became stable with it (maybe empty)."""
        self.tokens.append(token)
        window = self._decode(self._prefix)
        self.pending = window[len(self._prefix_text) :]
        if window.endswith(_INCOMPLETE) or len(window) <= len(self._prefix_text):
            return ""
        self._stable.append(self.pending)
        self._prefix, self._read = self._read, len(self.tokens)
        self._prefix_text = self._decode(self._prefix)
        stable, self.pending = self.pending, ""
        return stable

    @property
    def text(self) -> str:
        """The whole text so far (a character still arriving reads as U+FFFD, as decode gives it)."""
        return "".join(self._stable) + self.pending

    def _decode(self, start: int) -> str:
        return str(self._tokenizer.decode(self.tokens[start:], skip_special_tokens=True))


class StopMatcher:
    """Finds the first stop string in a growing text, keeping only a tail of what it has seen.

    A stop string not found in the text so far must end in the new text, so it starts
    within the last max(len(stop)) - 1 characters before it: only those are kept.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self._keep = max((len(s) for s in stop), default=1) - 1
        self._tail = ""
        self._before_tail = 0  # stable characters already dropped from the tail

    def find(self, stable: str, pending: str) -> int | None:
        """Where the earliest stop string starts in the whole text, once one appears.

        Args:
            stable: text that became stable since the last call (it never changes again).
            pending: the text after it, which may still change (a character still arriving).
        """
        if not self.stop:
            return None
        window = self._tail + stable + pending
        starts = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        if starts:
            return self._before_tail + min(starts)
        grown = self._tail + stable
        drop = max(len(grown) - self._keep, 0)
        self._before_tail += drop
        self._tail = grown[drop:]
        return None


class Completion:
    """One answer as it is decoded: its tokens, its text, and why it ended.

    Args:
        tokenizer: decodes the tokens (a Hugging Face tokenizer).
        sampling: `max_tokens` and `stop` end the answer.
        eos: token ids that end the answer; such a token is not kept.
    """

    def __init__(self, tokenizer: Any, sampling: Sampling, eos: Collection[int]) -> None:
        self._text = IncrementalText(tokenizer)
        self._stops = StopMatcher(sampling.stop)
        self._max_tokens = sampling.max_tokens
        self._eos = eos
        self._cut: int | None = None
        self.reason: str | None = None
        self.ended_by_eos = False
        self.stable = ""  # text made stable by the last token

    @property
    def tokens(self) -> list[int]:
        """The answer's tokens (an end-of-sequence token excluded; a stop string's token kept)."""
        return self._text.tokens

    @property
    def pending(self) -> str:
        """The end of the text that may still change (a character whose bytes are still arriving)."""
        return self._text.pending

    @property
    def text(self) -> str:
        """The answer's text, up to its first stop string."""
        text = self._text.text
        return text if self._cut is None else text[: self._cut]

    def add(self, token: int) -> str | None:
        """Take the next chosen token; the finish reason once the answer is complete.

        "stop": an end-of-sequence token or a stop string; "length": `max_tokens` tokens.
        """
        if self.reason is not None:
            raise RuntimeError(f"the answer already ended ({self.reason})")
        if token in self._eos:
            self.ended_by_eos, self.reason = True, "stop"
            return self.reason
        self.stable = self._text.add(token)
        self._cut = self._stops.find(self.stable, self._text.pending)
        if self._cut is not None:
            self.reason = "stop"
        elif len(self.tokens) >= self._max_tokens:
            self.reason = "length"
        return self.reason
