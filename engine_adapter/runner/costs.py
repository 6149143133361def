"""How much of a cached prefix to load and how much to compute: `CostModel`, `SplitPlan`.

A load is not always faster than recomputing: an 8B model in fp16 recomputes a 4k prefix in about
0.13 s on an H200, while reading its 537 MB from a disk at 1.7 GB/s takes 0.3 s. Both can run at
once, though: the GPU computes the head of the prefix from scratch while the disk delivers the
tail (Cake, "Compute or Load KV Cache? Why not both?"), and the question is then computed on top
of the two. Per request the model estimates, at every block boundary s,

    split(s) = max(compute(s tokens), read(tail bytes not in memory)) + max(copy(tail), question)

next to `recompute = compute(prompt)` and `full = split(0)`, and picks the least (s = 0 is the full
load, s = the prefix is recomputing). Its rates are this device's, measured online: the prefill's
seconds per token, `a + b * context` (the attention term grows with the context), fitted by least
squares over recent prefills; each tier's bytes per second from recent loads (decayed means). Until
a rate is measured a prior stands in (`Rates`), and until a prefill was measured the whole prefix
is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Weight of the newest observation in a tier's mean rate.
DECAY = 0.3
#: Least squares over this many recent prefills.
FIT_WINDOW = 32
#: A split must beat the best of the other two by this share to be chosen (the estimate's noise).
MARGIN = 0.05


@dataclass(frozen=True)
class Rates:
    """Priors until measured: bytes per second of each tier, seconds per computed token."""

    memory_bytes_s: float = 40e9  # host to device from page-locked memory
    disk_bytes_s: float = 1.0e9
    token_s: float = 1 / 2_000  # a prefill's seconds per token: slow, so that loads win until measured


@dataclass(frozen=True)
class SplitPlan:
    """A request's choice: compute tokens [0, compute_tokens) of the prefix from scratch, load the
    rest of it; with the estimates (seconds) behind it and why, for `generate -v`."""

    compute_tokens: int
    prefix_tokens: int
    estimate_s: float
    recompute_s: float
    full_s: float
    reason: str

    @property
    def load_tokens(self) -> int:
        """Prefix tokens loaded."""
        return self.prefix_tokens - self.compute_tokens

    @property
    def kind(self) -> str:
        """ "full" (load the whole prefix), "recompute" (load none) or "split"."""
        if self.compute_tokens == 0:
            return "full"
        return "recompute" if self.compute_tokens >= self.prefix_tokens else "split"


class CostModel:
    """The rates of one engine's device and store, and the choice they imply. Not thread-safe (one
    engine, one request at a time)."""

    def __init__(self, prior: Rates = Rates()) -> None:
        self.prior = prior
        self._tier_rate: dict[str, float] = {}
        self._layered: float | None = None  # a query-aware prefill's seconds per prefix token
        self._prefills: list[tuple[float, float, float]] = []  # (tokens, tokens * context, seconds)

    # -- what was measured ----------------------------------------------------------------------

    def observe_prefill(self, tokens: int, start: int, seconds: float) -> None:
        """A forward over `tokens` new tokens after `start` cached ones took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        self._prefills = [
            *self._prefills[-(FIT_WINDOW - 1) :],
            (tokens, tokens * (start + tokens / 2), seconds),
        ]

    def observe_read(self, tier: str, num_bytes: int, seconds: float) -> None:
        """`num_bytes` came from `tier` (read and made ready to copy) in `seconds`."""
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        old = self._tier_rate.get(tier)
        self._tier_rate[tier] = rate if old is None else (1 - DECAY) * old + DECAY * rate

    def observe_layered(self, prefix_tokens: int, seconds: float) -> None:
        """A query-aware prefill over `prefix_tokens` cached tokens took `seconds` in all."""
        if prefix_tokens <= 0 or seconds <= 0:
            return
        rate = seconds / prefix_tokens
        self._layered = rate if self._layered is None else (1 - DECAY) * self._layered + DECAY * rate

    def query_aware_pays(
        self, prefix_tokens: int, question_tokens: int, token_bytes: int, block_tokens: int,
        memory_fraction: float,
    ) -> bool:  # fmt: skip
        """Whether choosing chunks layer by layer is estimated faster than the best of loading and
        computing the whole prefix. Never measured, it is not (on a GPU a layer's choice costs more
        than copying all of its KV: issue #39's figures): a full load is exact, and then faster."""
        if self._layered is None:
            return False
        plan = self.plan(prefix_tokens, question_tokens, token_bytes, block_tokens, memory_fraction)
        return self._layered * prefix_tokens < plan.estimate_s

    # -- estimates ------------------------------------------------------------------------------

    def compute_s(self, tokens: int, start: int = 0) -> float:
        """Seconds to compute `tokens` new tokens after `start` cached ones."""
        if tokens <= 0:
            return 0.0
        per_token, per_pair = self._fit()
        return max(tokens * per_token + tokens * (start + tokens / 2) * per_pair, 0.0)

    def read_s(self, tier: str, num_bytes: int) -> float:
        """Seconds to read `num_bytes` from `tier`."""
        prior = self.prior.memory_bytes_s if tier == "memory" else self.prior.disk_bytes_s
        return num_bytes / self._tier_rate.get(tier, prior)

    def rate(self, tier: str) -> float:
        """Bytes per second of `tier`, measured or the prior."""
        prior = self.prior.memory_bytes_s if tier == "memory" else self.prior.disk_bytes_s
        return self._tier_rate.get(tier, prior)

    def _fit(self) -> tuple[float, float]:
        """(seconds per token, seconds per token and context token) from the recent prefills."""
        if not self._prefills:
            return self.prior.token_s, 0.0
        x = np.array([(n, pairs) for n, pairs, _ in self._prefills], dtype=np.float64)
        y = np.array([s for *_, s in self._prefills], dtype=np.float64)
        if len(self._prefills) >= 2 and np.linalg.matrix_rank(x) == 2:
            (per_token, per_pair), *_ = np.linalg.lstsq(x, y, rcond=None)
            if per_token > 0 and per_pair >= 0:
                return float(per_token), float(per_pair)
        return float(y.sum() / x[:, 0].sum()), 0.0  # one rate: the attention share folded in

    # -- the choice -----------------------------------------------------------------------------

    def plan(
        self, prefix_tokens: int, question_tokens: int, token_bytes: int, block_tokens: int,
        memory_fraction: float,
    ) -> SplitPlan:  # fmt: skip
        """The least of recompute, full load and every split at a block boundary.

        Args:
            prefix_tokens: cached tokens (whole blocks).
            question_tokens: tokens computed after the prefix in every case.
            token_bytes: KV bytes per token.
            block_tokens: split points lie on whole blocks.
            memory_fraction: share of the prefix's blocks the memory tier holds (the rest is read
                from disk; assumed spread evenly).
        """
        question = self.compute_s(question_tokens, prefix_tokens)
        recompute = self.compute_s(prefix_tokens + question_tokens)

        def split(s: int) -> float:
            tail = (prefix_tokens - s) * token_bytes
            read = self.read_s("disk", int(tail * (1 - memory_fraction)))
            return max(self.compute_s(s), read) + max(self.read_s("memory", tail), question)

        candidates = range(0, prefix_tokens, block_tokens)
        best = min(candidates, key=split, default=0)
        full = split(0)
        words = (
            f"est. recompute {recompute:.3f} s, full load {full:.3f} s"
            f" (disk {self.rate('disk') / 1e9:.2f} GB/s, {1 / max(self._fit()[0], 1e-12):,.0f} tokens/s)"
        )
        if not self._prefills:  # nothing measured on this device yet: do what costs least to undo
            return SplitPlan(
                0, prefix_tokens, full, recompute, full, f"full load (no prefill measured yet): {words}"
            )
        if recompute <= min(full, split(best)):
            return SplitPlan(prefix_tokens, prefix_tokens, recompute, recompute, full, f"recompute: {words}")
        if best == 0 or split(best) > (1 - MARGIN) * full:
            return SplitPlan(0, prefix_tokens, full, recompute, full, f"full load: {words}")
        return SplitPlan(
            best, prefix_tokens, split(best), recompute, full,
            f"compute the first {best} tokens while the other {prefix_tokens - best} load: "
            f"est. {split(best):.3f} s; {words}",
        )  # fmt: skip
