"""The engine: a real model that loads prefix KV from kvsieve instead of recomputing it.

`generate` loads the prompt's cached prefix from the store (an embedded
`TieredStore` or a `KVClient`: same interface) in one call, whose header says
how much matched (all of it, or its most important share under a budget),
builds the cache from the loaded chunks at their true positions, computes only
the new tokens, stores the new full blocks with their prefill scores, reports
how the new tokens attended to the prefix, then decodes. A request with new
tokens at a partial budget may instead load the prefix layer by layer, each
layer's chunks chosen by those tokens' queries (engine_adapter/runner/layered.py), and then, while
decoding, fetch the chunks each answer token needs (engine_adapter/runner/topup.py).

`Engine` is the facade: the prefill paths live in engine_adapter/runner/prefill.py, the
decode loops and the scoring here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from engine_adapter.runner.attention import AttentionStats
from engine_adapter.runner.batch import left_pad, padding_mask
from engine_adapter.runner.cache import cache_kwargs
from engine_adapter.runner.chat import ChatFormat
from engine_adapter.runner.choice import SplitPlan, choose, query_aware_fraction, request_for
from engine_adapter.runner.costs import CostModel
from engine_adapter.runner.decode import Completion, Sampler
from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.disk_probe import start_disk_probe
from engine_adapter.runner.layered import CHOOSE_WITH_LAST, LayeredReport, check_choose_with_last
from engine_adapter.runner.model import LoadedModel
from engine_adapter.runner.plans import FULL, QUERY_AWARE, RECOMPUTE, SPLIT, Option, Request
from engine_adapter.runner.prefill import (
    Prefill,
    Timings,
    forward,
    prefill_layered,
    prefill_static,
    recompute,
    synchronize,
)
from engine_adapter.runner.sampling import Sampling
from engine_adapter.runner.saver import DOWNLOAD_BUFFERS, BackgroundSaver, download_bytes
from engine_adapter.runner.split import prefill_split
from engine_adapter.runner.topup import TopUpSettings, decoding
from kvstore.api import LoadStream, PrefixStore
from kvstore.budget import Budget
from kvstore.load.device import as_array, torch_dtype

Messages = Sequence[dict[str, str]]


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
            tail: engine_adapter/runner/layered.py `CHOOSE_WITH_LAST`); None = every new token's.
        transfer: how loaded KV reaches the model's device (default: `KVTransfer` for
            the model's device: staged async copies on CUDA, today's conversion on CPU).
        topup: after a layer-by-layer prefill, fetch the chunks each decode token needs
            (engine_adapter/runner/topup.py); None = off.
        background_stores: store new blocks on a thread of the engine's own (`saver`), so that
            no request waits for a store (`flush_stores` waits); None = where the model computes
            on a device (on the CPU the store competes for the same cores: it is made in line).
            A request's `stored_blocks` then counts the blocks it queued.
        split: on a device, let the cost model choose how much of a cached prefix to load and how
            much to compute meanwhile (engine_adapter/runner/choice.py); False: load all of it.
        costs: the cost model (its rates, fixed costs and each plan's measured time on this
            device), e.g. shared by engines of one model; default a new one. On a device every
            request's plan and time are recorded in it, whether the engine chose or was told.
        query_aware: at a partial budget, choose each layer's chunks by the question's queries:
            None = on the CPU whenever the layered policy allows, on a device only where the cost
            model measured it faster than a full load (else the whole prefix is loaded: exact, and
            faster); True = whenever the policy allows; False = never.
        clock: seconds, for what each request's plan took (tests inject the time a plan takes).
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
        background_stores: bool | None = None,
        split: bool = True,
        costs: CostModel | None = None,
        query_aware: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.lm = lm
        self.transfer = transfer if transfer is not None else KVTransfer(lm.device)
        background = self.transfer.staged if background_stores is None else background_stores
        #: Where new blocks are stored off the request (None: in line, after the answer).
        self.saver = BackgroundSaver() if background and store is not None else None
        if self.saver is not None and self.transfer.staged:  # stores' copies off the device land in
            # buffers made now on a thread of their own, never allocated in line (saver.py)
            positions = getattr(lm.model.config, "max_position_embeddings", None)
            self.transfer.prepare_downloads(download_bytes(lm.spec.token_bytes, positions), DOWNLOAD_BUFFERS)
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
        #: This device's rates, and how much of a cached prefix to load and to compute.
        self.costs = costs if costs is not None else CostModel()
        self.split, self.query_aware = split, query_aware
        #: The cost model's choice for the last prefill (None where it did not choose).
        self.last_split: SplitPlan | None = None
        self.clock = clock
        if self.transfer.staged:  # the disk's rate, before the first cold request needs it
            start_disk_probe(self.costs, store)

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
        """`prefill`, its store possibly still pending (`Prefill.pending_store`).

        The paths themselves are engine_adapter/runner/prefill.py's: layer by layer when its
        policy says so, else the prefix loaded in one call. On a device the cost model chooses
        among them (engine_adapter/runner/choice.py) and learns what the one run took.
        """
        timings = Timings()
        self.last_load = self.last_layered = self.last_split = None
        self.transfer.last_error = ""
        t0 = self.clock()
        request = self._request(ids, budget)
        if request is not None and request.prefix_tokens and (request.split or request.query_aware):
            self.last_split = choose(self.costs, request)
        state, ran = self._run(ids, budget, request, timings)
        if request is not None and ran is not None:  # filed: the seconds to the logits, less the store
            synchronize(self.lm.device)  # the answer's first step waits for these logits anyway
            self.costs.record(ran, request, self.clock() - t0 - state.timings.store_s)
        return state

    def _run(
        self, ids: Sequence[int], budget: Budget, request: Request | None, timings: Timings
    ) -> tuple[Prefill, Option | None]:
        """Run the chosen plan (`last_split`), or the path this engine is set to; what ran."""
        plan = self.last_split
        if self._layered_first(plan):
            t0 = time.perf_counter()
            if (layered := prefill_layered(self, ids, budget, timings)) is not None:
                synchronize(self.lm.device)
                self.costs.observe_layered(layered.matched_tokens, time.perf_counter() - t0)
                if plan is not None:
                    return layered, plan.option
                qa = query_aware_fraction(budget)
                return layered, None if qa is None else Option(QUERY_AWARE, budget=qa)
            if plan is not None and request is not None:  # the policy refused: the best of the rest
                self.last_split = plan = choose(self.costs, replace(request, query_aware=None))
        if self.transfer.staged and budget != 1.0 and self.query_aware is not True:
            budget = 1.0  # the cost model says choosing cannot pay: the whole prefix, exact
        if plan is not None and plan.kind == RECOMPUTE:  # the prefix is cached: not stored again
            return recompute(self, ids, timings, stored_tokens=plan.prefix_tokens), plan.option
        if plan is not None and plan.kind == SPLIT:
            return prefill_split(self, ids, plan, timings), plan.option
        state = prefill_static(self, ids, budget, timings)
        if plan is not None:  # filed under the choice, whatever befell it (a failed copy recomputes)
            return state, plan.option
        if not state.loaded_tokens:  # nothing cached, or nothing loaded: the prompt was computed
            return state, Option(RECOMPUTE)
        return state, Option(FULL) if budget == 1.0 else None

    def _layered_first(self, plan: SplitPlan | None) -> bool:
        """Whether to try the layer-by-layer path (its policy may still refuse: see `query_aware`)."""
        if self.query_aware is not None or not self.transfer.staged:
            return self.query_aware is not False
        return plan is not None and plan.kind == QUERY_AWARE

    def _request(self, ids: Sequence[int], budget: Budget) -> Request | None:
        """Where the request stands, on a device (where the engine chooses and learns); else None."""
        if not self.transfer.staged:
            return None
        qa = query_aware_fraction(budget) if self.query_aware is None else None
        split = self.split and (budget == 1.0 or self.query_aware is not True)  # forced: no choice
        request = request_for(self.store, ids, self.lm.spec, self.namespace, split=split, query_aware=qa)
        if request.memory_fraction < 1.0:  # a cold prefix: the disk's rate matters now
            start_disk_probe(self.costs, self.store)
        return request

    def finish_store(self, state: Prefill) -> None:
        """Complete `state`'s pending store, if any: queued on the saver (its blocks counted as
        queued), or made here (waiting for its copy off the device)."""
        pending, state.pending_store = state.pending_store, None
        if pending is None:
            return
        if self.saver is None:
            state.stored_blocks = pending()
            return
        block = self.store.info.block_tokens if self.store is not None else None
        new_tokens = state.next_position - state.matched_tokens
        queued = self.saver.submit(new_tokens * self.lm.spec.token_bytes, pending)
        state.stored_blocks = (
            (state.next_position // block - state.matched_tokens // block) if (queued and block) else 0
        )

    def flush_stores(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued store is made (a no-op without a saver); False on timeout."""
        return True if self.saver is None else self.saver.flush(timeout_s)

    @torch.inference_mode()
    def analyze(self, ids: Sequence[int]) -> tuple[np.ndarray[Any, Any], AttentionStats]:
        """Compute a prefix from scratch: its KV (the spec's dtype, layer-major) and attention statistics."""
        from transformers import DynamicCache

        stats = AttentionStats(0, self.lm.spec.num_layers)
        cache = DynamicCache(config=self.lm.model.config)
        forward(self.lm, ids, 0, cache, stats)
        kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])
        return as_array(kv.to(torch_dtype(self.lm.spec.np_dtype)).cpu()), stats

    @torch.inference_mode()
    def extend(self, ids: Sequence[int], start: int, cache: Any, last_only: bool = False) -> torch.Tensor:
        """Compute `ids` at positions start.. on top of `cache` (appended in place); their logits.

        With `last_only`, the logits of the last token only (one row).
        """
        return forward(self.lm, ids, start, cache, None, last_only)[0]

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
            logits = forward(self.lm, answer.tokens[-1:], position, state.cache, None)[0, -1]
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
        input_ids = left_pad([torch.tensor(row, dtype=torch.long, device=device) for row in rows], 0, pad)
        mask = padding_mask([len(row) for row in rows], device=device)
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
                rows.append(forward(self.lm, step, start, state.cache, None)[0])
                start += len(step)
        return torch.cat(rows, dim=0)


def _batch_result(answer: Completion, prompt_tokens: int, timings: Timings) -> GenerateResult:
    """A row of `generate_batch`: no prefix reuse, so every prompt token was computed."""
    reason = answer.reason or "length"
    return GenerateResult(answer.text, answer.tokens, prompt_tokens, 0, 0, prompt_tokens, 0, reason, timings)
