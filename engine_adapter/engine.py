"""The engine: a real model that loads prefix KV from kvsieve instead of recomputing it.

`generate` loads the prompt's cached prefix from the store (an embedded
`TieredStore` or a `KVClient`: same interface) in one call, whose header says
how much matched (all of it, or its most important share under a budget),
builds the cache from the loaded chunks at their true positions, computes only
the new tokens, stores the new full blocks with their prefill scores, reports
how the new tokens attended to the prefix, then decodes. A request with new
tokens at a partial budget may instead load the prefix layer by layer, each
layer's chunks chosen by those tokens' queries (engine_adapter/layered.py), and then, while
decoding, fetch the chunks each answer token needs (engine_adapter/topup.py).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from engine_adapter.attention import AttentionStats
from engine_adapter.batch import left_pad, padding_mask
from engine_adapter.cache import cache_from, cache_kwargs
from engine_adapter.chat import ChatFormat
from engine_adapter.decode import Completion, Sampler
from engine_adapter.device import KVTransfer, LayerUpload
from engine_adapter.layered import CHOOSE_WITH_LAST, LayeredReport, check_choose_with_last, layered_prefill
from engine_adapter.layered_policy import plan_layered
from engine_adapter.model import LoadedModel
from engine_adapter.sampling import Sampling
from engine_adapter.topup import DecodeTopUp, TopUpSettings, decoding
from kvstore.api import LoadStream, PrefixStore
from kvstore.budget import Budget
from kvstore.errors import KVSieveError
from kvstore.load.buffers import StagingError

Messages = Sequence[dict[str, str]]


@dataclass
class Timings:
    """Seconds spent in each phase of one request."""

    lookup_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class Prefill:
    """State after the prompt: the cache, the logits of its last token, and what was reused."""

    cache: Any
    logits: torch.Tensor
    next_position: int
    matched_tokens: int = 0
    loaded_tokens: int = 0
    computed_tokens: int = 0
    stored_blocks: int = 0
    timings: Timings = field(default_factory=Timings)
    #: Completes the store of the new blocks (their KV on its way off the device):
    #: `Engine.finish_store` calls it once the answer is decoded.
    pending_store: Callable[[], int] | None = None
    #: The decode-time top-up of a layer-by-layer prefill (engine_adapter/topup.py), holding its load.
    topup: DecodeTopUp | None = None


class Loaded(NamedTuple):
    """A prefix loaded for prefill: its tokens' positions, the cache, the prefix length covered,
    and its copy to the device (None when the cache already holds it)."""

    positions: Any
    cache: Any
    covered: int
    upload: LayerUpload | None = None


@dataclass(frozen=True)
class GenerateResult:
    """An answer and where its time went."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    matched_tokens: int
    loaded_tokens: int
    computed_tokens: int
    stored_blocks: int
    finish_reason: str
    timings: Timings


class Engine:
    """Runs a `LoadedModel` with prefix KV from a store. Not thread-safe (one model, one request).

    Args:
        lm: the model.
        store: embedded store or client; None = no reuse (recompute everything).
        namespace: tenant whose KV is read and written.
        collect_stats: compute attention statistics for prefill and history scores
            (explicit attention instead of sdpa while computing the prompt).
        choose_with_last: on the layer-by-layer path, the last this many new tokens'
            queries choose each layer's chunks (the question, not the document's uncached
            tail: engine_adapter/layered.py `CHOOSE_WITH_LAST`); None = every new token's.
        transfer: how loaded KV reaches the model's device (default: `KVTransfer` for
            the model's device: staged async copies on CUDA, today's conversion on CPU).
        topup: after a layer-by-layer prefill, fetch the chunks each decode token needs
            (engine_adapter/topup.py); None = off.
    """

    def __init__(
        self,
        lm: LoadedModel,
        store: PrefixStore | None = None,
        namespace: str = "default",
        collect_stats: bool = True,
        choose_with_last: int | None = CHOOSE_WITH_LAST,
        transfer: KVTransfer | None = None,
        topup: TopUpSettings | None = TopUpSettings(),  # noqa: B008 (frozen: one shared default is safe)
    ) -> None:
        self.lm = lm
        self.transfer = transfer if transfer is not None else KVTransfer(lm.device)
        self.store = store
        self.namespace = namespace
        self.collect_stats = collect_stats
        check_choose_with_last(choose_with_last)  # here, not as a fallback mid-request
        self.choose_with_last = choose_with_last
        self.topup = topup
        #: Chat turns as token ids, from the tokenizer's chat template (the DSL's messages too).
        self.chat = ChatFormat(lm.tokenizer)
        #: The last prefill's load stream (closed): what its budget delivered and read.
        self.last_load: LoadStream | None = None
        #: The last prefill's layer-by-layer load, if it took that path (or tried and fell back).
        self.last_layered: LayeredReport | None = None

    # -- prompts ------------------------------------------------------------------

    def encode(self, prompt: str | Messages | Sequence[int]) -> list[int]:
        """Token ids of a prompt: ids as given, a string as one user message, or chat messages."""
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt[0], dict):
            ids = self.lm.tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return [int(t) for t in prompt]  # type: ignore[arg-type]

    # -- prefill ------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int], budget: Budget = 1.0) -> Prefill:
        """Compute the prompt, reusing cached prefix KV; stores and reports as described above."""
        state = self._prefill(ids, budget)
        self.finish_store(state)
        if state.topup is not None:  # no decode here goes through the top-up's hooks
            state.topup.close()
            state.topup = None
        return state

    def _prefill(self, ids: Sequence[int], budget: Budget) -> Prefill:
        """`prefill`, its store possibly still pending (`Prefill.pending_store`)."""
        timings = Timings()
        self.last_load = self.last_layered = None
        self.transfer.last_error = ""
        if (layered := self._prefill_layered(ids, budget, timings)) is not None:
            return layered
        return self._prefill_static(ids, budget, timings)

    def finish_store(self, state: Prefill) -> None:
        """Complete `state`'s pending store (waits for its copy off the device), if any."""
        if state.pending_store is not None:
            state.stored_blocks, state.pending_store = state.pending_store(), None

    def _prefill_static(
        self, ids: Sequence[int], budget: Budget, timings: Timings, reuse: bool = True
    ) -> Prefill:
        """Load the prefix in one call (if `reuse`), compute the rest, store and report.

        A copy to the device that fails (out of memory, a CUDA error) abandons the
        loaded prefix: the prompt is recomputed (`transfer.last_error` says why).
        """
        try:
            positions, cache, matched, upload = self._load(ids, budget if reuse else None, timings)
            loaded = len(positions)
            stats = AttentionStats(loaded, self.lm.spec.num_layers) if self.collect_stats else None
            t0 = time.perf_counter()
            with upload.attached(self.lm.model) if upload is not None else contextlib.nullcontext():
                logits = self._forward(ids[matched:], matched, cache, stats)
        except StagingError as exc:
            if not reuse:
                raise
            self.transfer.last_error = str(exc)
            return self._recompute(ids, timings)
        timings.prefill_s = time.perf_counter() - t0
        state = Prefill(cache, logits[0, -1], len(ids), matched, loaded, len(ids) - matched, timings=timings)
        if loaded == matched:  # KV computed over a partial prefix is approximate: never store it
            state.pending_store = self._store_new(ids, matched, cache, stats)
            if stats is not None and matched:
                self._report(ids[:matched], stats)
        return state

    def _prefill_layered(self, ids: Sequence[int], budget: Budget, timings: Timings) -> Prefill | None:
        """The layer-by-layer path (engine_adapter/layered_policy.py says when), or None.

        A store error mid-pass abandons it: the prompt is recomputed without the store. On a
        device, `layered_prefill` builds its cache and inputs there and each layer's chosen
        chunks go through the shared staging copier (`copy_into_cache`); a failed copy
        (`StagingError`) abandons the pass the same way.
        """
        if self.store is None:
            return None
        t0 = time.perf_counter()
        plan = plan_layered(self.store, ids, budget, model=self.lm.spec, namespace=self.namespace)
        if plan is None:
            return None
        timings.lookup_s = time.perf_counter() - t0
        matched = int(plan.load.matched_tokens)
        try:  # the load stays open for the top-up, which then owns it
            out = layered_prefill(
                self.lm.model, plan.load, ids[matched:], plan.chunks, self.choose_with_last,
                keep_summaries=self.topup is not None,
            )  # fmt: skip
        except (KVSieveError, StagingError) as exc:
            plan.load.close()
            self.last_layered = LayeredReport(matched, plan.load.chunk_tokens, plan.chunks, error=str(exc))
            return self._recompute(ids, timings)
        except BaseException:
            plan.load.close()
            raise
        topup = None if self.topup is None else DecodeTopUp(plan.load, out, self.topup)
        if topup is None:
            plan.load.close()
        self.last_layered = out.report
        timings.load_s = out.report.load_s
        timings.prefill_s = time.perf_counter() - t0 - timings.lookup_s - out.report.load_s
        loaded = plan.chunks * plan.load.chunk_tokens  # per layer; never stored (an approximation)
        return Prefill(
            out.cache, out.logits[0, -1], len(ids), matched, loaded, len(ids) - matched, timings=timings,
            topup=topup,
        )  # fmt: skip

    def _recompute(self, ids: Sequence[int], timings: Timings) -> Prefill:
        """The whole prompt computed, nothing loaded, its new blocks stored (after a failed layered load)."""
        return self._prefill_static(ids, 1.0, timings, reuse=False)

    def _load(self, ids: Sequence[int], budget: Budget | None, timings: Timings) -> Loaded:
        """The loaded prefix: positions of its tokens, the cache holding them, prefix length covered.

        With `budget` None nothing is loaded (the whole prompt is computed).

        One Load call: its header answers what a Lookup would (the matched prefix),
        so no separate round trip. At least the last token is computed: its logits
        start the answer. With a staged transfer (CUDA) the cache's tensors are filled
        layer by layer during the forward pass (`Loaded.upload`).
        """
        from transformers import DynamicCache

        cache = DynamicCache(config=self.lm.model.config)
        if self.store is None or budget is None or len(ids) < 2:
            return Loaded(np.zeros(0, np.int64), cache, 0)
        t0 = time.perf_counter()
        stream = self.store.load(ids[:-1], model=self.lm.spec, namespace=self.namespace, budget=budget)
        self.last_load = stream  # its fractions stay readable after close (`generate -v`)
        with contextlib.ExitStack() as closing:
            closing.enter_context(stream)
            timings.lookup_s = time.perf_counter() - t0  # until the match was known
            positions, kv = stream.gather(self.lm.spec)
            covered = int(stream.num_tokens)  # shorter than matched if a block was corrupt
            if not covered or not len(positions):
                return Loaded(np.zeros(0, np.int64), cache, 0)
            if self.transfer.staged:
                positions, order = position_order(positions)
                # `kv` may be a view of the stream's buffers, read layer by layer during
                # the forward pass: the upload closes the stream once every layer is copied.
                upload = self.transfer.upload(kv, order, self.lm.dtype, owner=closing.pop_all())
                timings.load_s = time.perf_counter() - t0
                return Loaded(positions, cache_from(self.lm.model.config, upload.pairs), covered, upload)
            positions, tensor = cache_tensor(positions, kv)
        cache = cache_from(self.lm.model.config, [(t[0].unsqueeze(0), t[1].unsqueeze(0)) for t in tensor])
        timings.load_s = time.perf_counter() - t0
        return Loaded(positions, cache, covered)

    def _forward(
        self,
        ids: Sequence[int],
        start: int,
        cache: Any,
        stats: AttentionStats | None,
        last_only: bool = False,
    ) -> torch.Tensor:
        device = self.lm.device
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        position_ids = torch.arange(start, start + len(ids), device=device).unsqueeze(0)
        extra: dict[str, Any] = {"kvsieve_stats": stats} if stats is not None else {}
        if last_only:  # the vocabulary projection of every prompt token costs ~20 % of a prefill
            extra["logits_to_keep"] = 1
        out = self.lm.model(
            input_ids=input_ids, position_ids=position_ids, **cache_kwargs(self.lm.model, cache), **extra
        )
        return out.logits

    @torch.inference_mode()
    def analyze(self, ids: Sequence[int]) -> tuple[np.ndarray[Any, Any], AttentionStats]:
        """Compute a prefix from scratch: its KV (fp16, layer-major) and attention statistics."""
        from transformers import DynamicCache

        stats = AttentionStats(0, self.lm.spec.num_layers)
        cache = DynamicCache(config=self.lm.model.config)
        self._forward(ids, 0, cache, stats)
        kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])
        return kv.to(torch.float16).cpu().numpy(), stats

    @torch.inference_mode()
    def extend(self, ids: Sequence[int], start: int, cache: Any, last_only: bool = False) -> torch.Tensor:
        """Compute `ids` at positions start.. on top of `cache` (appended in place); their logits.

        With `last_only`, the logits of the last token only (one row).
        """
        return self._forward(ids, start, cache, None, last_only)[0]

    def _store_new(
        self, ids: Sequence[int], start: int, cache: Any, stats: AttentionStats | None
    ) -> Callable[[], int] | None:
        """Store the new full blocks; what completes the store (None: nothing to store).

        On the CPU the store is made here. Through a staged transfer (CUDA) the KV only
        starts its copy off the device here, on the copy stream: the store is made when
        `finish_store` calls the returned function, after the answer is decoded.
        """
        block = self._block_tokens()
        if self.store is None or len(ids) <= start:
            return None
        if block is not None and len(ids) // block * block <= start:
            return None  # no new full block: skip building the KV array
        layers = cache.layers
        kv = torch.stack(
            [
                torch.stack([layers[i].keys[0, :, start:], layers[i].values[0, :, start:]])
                for i in range(len(layers))
            ]
        ).to(torch.float16)
        store = self.store

        def finish(kv16: np.ndarray[Any, Any]) -> int:
            scores = stats.prefill if stats is not None else None
            result = store.store(
                np.asarray(ids), kv16, model=self.lm.spec, namespace=self.namespace, scores=scores,
                kv_start=start,
            )  # fmt: skip
            return int(result.new_blocks)

        if not self.transfer.staged:
            stored = finish(kv.numpy())
            return lambda: stored
        try:
            pending = self.transfer.download(kv)
        except StagingError as exc:  # not stored: the answer does not depend on it
            self.transfer.last_error = str(exc)
            return None
        return lambda: finish(pending.result())

    def _report(self, prefix: Sequence[int], stats: AttentionStats) -> None:
        assert self.store is not None
        history = stats.history
        if len(history) == len(prefix):
            self.store.report_scores(
                np.asarray(prefix), history, model=self.lm.spec, namespace=self.namespace
            )

    def _block_tokens(self) -> int | None:
        """Block size of an embedded store; None for a sidecar (it drops partial blocks itself)."""
        return None if self.store is None else self.store.info.block_tokens

    # -- decode -------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, prompt: str | Messages | Sequence[int], sampling: Sampling | None = None, budget: Budget = 1.0
    ) -> GenerateResult:
        """Answer a prompt (see module docstring)."""
        sampling = sampling or Sampling()
        ids = self.encode(prompt)
        state = self._prefill(ids, budget)
        t0 = time.perf_counter()
        with decoding(self.lm.model, state.topup):
            tokens, text, reason = self._decode(state, sampling)
        state.timings.decode_s = time.perf_counter() - t0
        self.finish_store(state)  # its copy off the device ran while the answer was decoded
        return GenerateResult(
            text, tokens, len(ids), state.matched_tokens, state.loaded_tokens, state.computed_tokens,
            state.stored_blocks, reason, state.timings,
        )  # fmt: skip

    def _decode(self, state: Prefill, sampling: Sampling) -> tuple[list[int], str, str]:
        sampler = Sampler(sampling)
        answer = Completion(self.lm.tokenizer, sampling, self.lm.eos_token_ids)
        logits, position = state.logits, state.next_position
        while (reason := answer.add(int(sampler(logits.unsqueeze(0))[0]))) is None:
            logits = self._forward(answer.tokens[-1:], position, state.cache, None)[0, -1]
            position += 1
        return answer.tokens, answer.text, reason

    @torch.inference_mode()
    def generate_batch(
        self, prompts: Sequence[str | Messages | Sequence[int]], sampling: Sampling | None = None
    ) -> list[GenerateResult]:
        """Answer several prompts as one batch (left-padded, masked, true positions per row).

        No prefix reuse here: each row is computed whole. Rows that finish keep
        feeding their last token, masked out of nothing but ignored in the results.
        """
        sampling = sampling or Sampling()
        rows = [self.encode(p) for p in prompts]
        t0 = time.perf_counter()
        logits, cache, mask, positions = self._batch_prefill(rows)
        prefill_s = time.perf_counter() - t0
        sampler = Sampler(sampling)
        answers = [Completion(self.lm.tokenizer, sampling, self.lm.eos_token_ids) for _ in rows]
        t0 = time.perf_counter()
        while True:
            chosen = sampler(logits)
            for answer, token in zip(answers, chosen.tolist(), strict=True):
                if answer.reason is None:
                    answer.add(token)
            if all(a.reason is not None for a in answers):
                break
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype, device=mask.device)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.lm.model(
                input_ids=chosen.unsqueeze(1), attention_mask=mask, position_ids=positions,
                **cache_kwargs(self.lm.model, cache),
            )  # fmt: skip
            logits = out.logits[:, -1]
        decode_s = time.perf_counter() - t0
        return [
            _batch_result(answer, len(row), Timings(prefill_s=prefill_s, decode_s=decode_s))
            for row, answer in zip(rows, answers, strict=True)
        ]

    def _batch_prefill(self, rows: list[list[int]]) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        from transformers import DynamicCache

        pad = self.lm.tokenizer.pad_token_id or 0
        device = self.lm.device
        input_ids = left_pad([torch.tensor(row, dtype=torch.long) for row in rows], dim=0, fill=pad)
        input_ids = input_ids.to(device)
        mask = padding_mask([len(row) for row in rows]).to(device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.lm.model.config)  # ours: the output's name for it changed too
        out = self.lm.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions,
            **cache_kwargs(self.lm.model, cache),
        )  # fmt: skip
        return out.logits[:, -1], cache, mask, positions

    # -- scoring ------------------------------------------------------------------

    @torch.inference_mode()
    def continuation_logits(
        self, prefix: Sequence[int], continuation: Sequence[int], budget: Budget = 1.0
    ) -> torch.Tensor:
        """Logits predicting each token of `continuation` after `prefix` (teacher forcing).

        Row i predicts continuation[i]. Used to measure the quality of partial loads. With a
        top-up, one token at a time, as `generate` decodes (each token's fetches seen by it on).
        """
        state = self._prefill(prefix, budget)
        self.finish_store(state)
        rows, start, model = [state.logits.unsqueeze(0)], state.next_position, self.lm.model
        with decoding(model, state.topup):
            steps = [continuation[:-1]] if state.topup is None else [[t] for t in continuation[:-1]]
            for step in (s for s in steps if len(s)):
                rows.append(self._forward(step, start, state.cache, None)[0])
                start += len(step)
        return torch.cat(rows, dim=0)


def _batch_result(answer: Completion, prompt_tokens: int, timings: Timings) -> GenerateResult:
    """A row of `generate_batch`: no prefix reuse, so every prompt token was computed."""
    reason = answer.reason or "length"
    return GenerateResult(answer.text, answer.tokens, prompt_tokens, 0, 0, prompt_tokens, 0, reason, timings)


def position_order(positions: np.ndarray[Any, Any]) -> tuple[Any, np.ndarray[Any, Any] | None]:
    """(positions ascending, the order that sorts them), the order None if already ascending."""
    if len(positions) > 1 and not bool(np.all(positions[1:] > positions[:-1])):
        order = np.argsort(positions, kind="stable")
        return positions[order], order
    return positions, None


def cache_tensor(positions: np.ndarray[Any, Any], kv: np.ndarray[Any, Any]) -> tuple[Any, torch.Tensor]:
    """Loaded KV (layers, 2, heads, n, dim) as float32 in position order: the one dtype
    conversion, into a preallocated tensor; a reorder copy only if out of position order.

    `kv` may be a read-only view of shared memory: it is only read here.
    """
    with warnings.catch_warnings():  # torch warns about read-only arrays; the source is never written
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(kv)
    if len(positions) > 1 and not bool(np.all(positions[1:] > positions[:-1])):
        order = np.argsort(positions, kind="stable")
        positions = positions[order]
        source = source.index_select(3, torch.from_numpy(order))
    out = torch.empty(source.shape, dtype=torch.float32)
    out.copy_(source)
    return positions, out
