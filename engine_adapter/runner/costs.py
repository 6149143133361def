"""What each plan of a request costs on this device: `CostModel`, its rates, its fixed costs and what
it measured.

A load is not always faster than recomputing: an 8B model in fp16 recomputes a 4k prefix in about
0.13 s on an H200, while reading its 537 MB from a disk at 1.7 GB/s takes 0.3 s. Both can run at
once, though: the GPU computes the head of the prefix from scratch while the disk delivers the
tail (Cake, "Compute or Load KV Cache? Why not both?"), and the question is then computed on top
of the two. The model estimates, for a split that computes the first s tokens of the prefix,

    split(s) = max(compute(s tokens), read(tail bytes not in memory)) + max(copy(tail), question)

next to `recompute = compute(prompt)` and `full = split(0)`. Its rates are this device's, measured
online: the prefill's seconds per token, `a + b * context` (the attention term grows with the
context), fitted by least squares over recent prefills; each tier's bytes per second from recent
loads (decayed means); the disk's also from a sequential read of the store's data file in the
background at start (engine_adapter/runner/disk_probe.py), so that the first cold request does not
decide on the prior (issue 47: it did, on `Rates.disk_bytes_s`, and took 30x a recompute).

Rates miss what every run of a plan pays whatever its size: opening the read, page-locking new
arena segments, starting the tail's thread, Python per request; and a rate can be wrong. After each
run the plan kind's calibration (engine_adapter/runner/calibration.py) learns by how much, and the
kind's later estimates, at every length, include it.

Estimates only fill in: `record` files what each run took (engine_adapter/runner/measured.py), and
the choice (engine_adapter/runner/choice.py) compares measured plans by their measurements alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine_adapter.runner.calibration import Calibration, Where
from engine_adapter.runner.measured import PlanLog
from engine_adapter.runner.plans import QUERY_AWARE, RECOMPUTE, SPLIT, Option, Request, tier_bucket

if TYPE_CHECKING:
    from engine_adapter.runner.disk_probe import DiskProbe

#: Weight of the newest observation in a tier's mean rate and in a plan kind's intercept.
DECAY = 0.3
#: Least squares over this many recent prefills: few, so that what this device did in the last
#: couple of requests replaces a wrong rate (a prior, another machine's) within them. Accuracy
#: comes from the measurements (measured.py); the fit only has to point at plans worth trying.
FIT_WINDOW = 4


@dataclass(frozen=True)
class Rates:
    """Priors until measured: bytes per second of each tier, seconds per computed token."""

    memory_bytes_s: float = 40e9  # host to device from page-locked memory
    disk_bytes_s: float = 1.0e9
    token_s: float = 1 / 2_000  # a prefill's seconds per token: slow, so that loads win until measured


class CostModel:
    """The rates of one engine's device and store, the fixed costs of its plans and what its plans
    measured. Not thread-safe (one engine, one request at a time), except `observe_disk_probe`,
    which the disk probe's thread calls (one attribute, written once)."""

    def __init__(self, prior: Rates = Rates()) -> None:
        self.prior = prior
        self._tier_rate: dict[str, float] = {}
        self._probed_disk: float | None = None
        self._layered: float | None = None  # a query-aware prefill's seconds per prefix token
        self._prefills: list[tuple[float, float, float]] = []  # (tokens, tokens * context, seconds)
        self._fitted: tuple[float, float] | None = None  # `_fit`'s answer until the next prefill
        self.calibration = Calibration()
        self._requests: dict[tuple[int, int, int], int] = {}  # runs recorded per `Request.place`
        #: What each plan took, by where its request stood (engine_adapter/runner/measured.py).
        self.log = PlanLog()
        #: The background read that measures the disk, once started (disk_probe.py); None before.
        self.disk_probe: DiskProbe | None = None

    # -- what was measured ----------------------------------------------------------------------

    def observe_prefill(self, tokens: int, start: int, seconds: float) -> None:
        """A forward over `tokens` new tokens after `start` cached ones took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        self._prefills = [
            *self._prefills[-(FIT_WINDOW - 1) :],
            (tokens, tokens * (start + tokens / 2), seconds),
        ]
        self._fitted = None

    def observe_read(self, tier: str, num_bytes: int, seconds: float) -> None:
        """`num_bytes` came from `tier` (read and made ready to copy) in `seconds`."""
        if num_bytes <= 0 or seconds <= 0:
            return
        rate = num_bytes / seconds
        old = self._tier_rate.get(tier)
        self._tier_rate[tier] = rate if old is None else (1 - DECAY) * old + DECAY * rate

    def observe_disk_probe(self, bytes_s: float) -> None:
        """The disk read the store's data file sequentially at `bytes_s` (disk_probe.py): the
        disk's rate until a load measures its own."""
        if bytes_s > 0:
            self._probed_disk = bytes_s

    def observe_layered(self, prefix_tokens: int, seconds: float) -> None:
        """A query-aware prefill over `prefix_tokens` cached tokens took `seconds` in all."""
        if prefix_tokens <= 0 or seconds <= 0:
            return
        rate = seconds / prefix_tokens
        self._layered = rate if self._layered is None else (1 - DECAY) * self._layered + DECAY * rate

    def record(self, option: Option, request: Request, seconds: float) -> None:
        """`option` ran for `request` and took `seconds` (its prefill, from the choice to the first
        logits): filed as its measurement, and how far it fell from the rates' estimate learned
        for its kind."""
        if seconds <= 0:
            return
        self.log.record(request.key(option), request.prompt_tokens, seconds)
        self._requests[request.place] = self._requests.get(request.place, 0) + 1
        rated = self.rates_s(option, request)
        if rated is not None:
            self.calibration.learn(_where(option, request), rated, seconds)

    @property
    def prefill_measured(self) -> bool:
        """Whether any prefill was measured on this device (until then, compute estimates are priors)."""
        return bool(self._prefills)

    def requests_at(self, request: Request) -> int:
        """How many runs were recorded where `request` stands (its `place`), whatever their plan."""
        return self._requests.get(request.place, 0)

    # -- estimates ------------------------------------------------------------------------------

    def measured_s(self, option: Option, request: Request) -> float | None:
        """What `option` measured at `request`'s key, scaled to its prompt; None if never run there."""
        return self.log.seconds(request.key(option), request.prompt_tokens)

    def estimate_s(self, option: Option, request: Request) -> float | None:
        """Seconds `option` is estimated to take: the rates' estimate as its kind's runs turned out
        (calibration.py); None where nothing estimates it (a query-aware load never measured)."""
        rated = self.rates_s(option, request)
        return None if rated is None else self.calibration.apply(_where(option, request), rated)

    def rates_s(self, option: Option, request: Request) -> float | None:
        """The rates' estimate of `option` alone (module docstring), no fixed cost."""
        if option.kind == RECOMPUTE:
            return self.compute_s(request.prompt_tokens)
        if option.kind == QUERY_AWARE:
            return None if self._layered is None else self._layered * request.prefix_tokens
        head = request.compute_tokens(option) if option.kind == SPLIT else 0
        tail = (request.prefix_tokens - head) * request.token_bytes
        read = self.read_s("disk", int(tail * (1 - request.memory_fraction)))
        question = self.compute_s(request.question_tokens, request.prefix_tokens)
        return max(self.compute_s(head), read) + max(self.read_s("memory", tail), question)

    def compute_s(self, tokens: int, start: int = 0) -> float:
        """Seconds to compute `tokens` new tokens after `start` cached ones."""
        if tokens <= 0:
            return 0.0
        per_token, per_pair = self._fit()
        return max(tokens * per_token + tokens * (start + tokens / 2) * per_pair, 0.0)

    def read_s(self, tier: str, num_bytes: int) -> float:
        """Seconds to read `num_bytes` from `tier`."""
        return num_bytes / self.rate(tier)

    def rate(self, tier: str) -> float:
        """Bytes per second of `tier`: measured by loads, else (the disk) probed, else the prior."""
        if tier in self._tier_rate:
            return self._tier_rate[tier]
        if tier != "memory" and self._probed_disk is not None:
            return self._probed_disk
        return self.prior.memory_bytes_s if tier == "memory" else self.prior.disk_bytes_s

    def rate_words(self) -> str:
        """The disk's rate and where it came from, and the prefill's, for a plan's reason."""
        source = "measured" if "disk" in self._tier_rate else "probed" if self._probed_disk else "prior"
        tokens_s = 1 / max(self._fit()[0], 1e-12)
        return f"disk {self.rate('disk') / 1e9:.2f} GB/s ({source}), {tokens_s:,.0f} tokens/s"

    def _fit(self) -> tuple[float, float]:
        """(seconds per token, seconds per token and context token) from the recent prefills; fitted
        once per new prefill (a choice asks for it once per option: it must cost microseconds)."""
        if self._fitted is None:
            self._fitted = self._least_squares()
        return self._fitted

    def _least_squares(self) -> tuple[float, float]:
        if not self._prefills:
            return self.prior.token_s, 0.0
        x = np.array([(n, pairs) for n, pairs, _ in self._prefills], dtype=np.float64)
        y = np.array([s for *_, s in self._prefills], dtype=np.float64)
        if len(self._prefills) >= 2 and np.linalg.matrix_rank(x) == 2:
            (per_token, per_pair), *_ = np.linalg.lstsq(x, y, rcond=None)
            if per_token > 0 and per_pair >= 0:
                return float(per_token), float(per_pair)
        return float(y.sum() / x[:, 0].sum()), 0.0  # one rate: the attention share folded in


def _where(option: Option, request: Request) -> Where:
    """A kind's calibration goes by its tier state too (a cold read opens and page-locks)."""
    if option.kind == RECOMPUTE:
        return RECOMPUTE, None
    return option.kind, tier_bucket(request.memory_fraction)
