"""KVSieveConnector: vLLM's KV connector API (v1) over a `kvsieve serve` sidecar.

Named in vLLM's `--kv-transfer-config` as
`{"kv_connector": "KVSieveConnector", "kv_connector_module_path":
"engine_adapter.vllm.connector", "kv_role": "kv_both", "kv_connector_extra_config": {...}}`
(see docs/vllm.md). The scheduler half asks the sidecar how much of a prompt is
cached and plans the step (`plan.RequestTracker`); the worker half moves the
bytes (`worker.WorkerSide`). vLLM cannot hold a sparse prefix, so this path
always loads whole blocks (budget 1.0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from engine_adapter.vllm import layout
from engine_adapter.vllm.events import HeldBlockEvents
from engine_adapter.vllm.fingerprint import vllm_model_spec
from engine_adapter.vllm.guard import SidecarGuard
from engine_adapter.vllm.plan import RequestTracker, ScheduledRequest, StepPlan
from engine_adapter.vllm.settings import ConnectorSettings
from engine_adapter.vllm.timings import TimingLog
from engine_adapter.vllm.worker import WorkerSide
from kvstore.client.kvclient import KVClient
from kvstore.errors import InvalidInputError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# A child of vLLM's logger: its handler and format apply, and `vllm serve` shows it.
logger = logging.getLogger("vllm.kvsieve")


@dataclass
class KVSieveMetadata(KVConnectorMetadata):
    """The step plan, shipped from the scheduler process to the worker."""

    plan: StepPlan = field(default_factory=StepPlan)


class KVSieveConnector(KVConnectorBase_V1):
    """Loads cached prefixes from a kvsieve sidecar into vLLM and stores new full blocks there."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        if transfer.kv_load_failure_policy != "recompute":
            # A failed load must cost a recompute, never the request: that is this connector's contract.
            logger.info("KVSieveConnector sets kv_load_failure_policy='recompute' (was %r)",
                        transfer.kv_load_failure_policy)  # fmt: skip
            transfer.kv_load_failure_policy = "recompute"
        self.spec = vllm_model_spec(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.guard = SidecarGuard(self.settings.retry_after_s, log=logger)
        scheduler = role == KVConnectorRole.SCHEDULER
        self.client = KVClient(
            self.settings.store,
            token=self.settings.token,
            use_shm="auto" if self.settings.use_shm else False,
            timeout_s=self.settings.lookup_timeout_s if scheduler else self.settings.timeout_s,
        )
        s = self.settings
        self.tracker = RequestTracker(self.block_size, s.block_tokens, loads=s.loads, saves=s.saves)
        self.timings = TimingLog(s.timings_path, logger)
        self.worker = WorkerSide(self.client, self.spec, s.namespace, self.block_size, self.guard,
                                 s.save_queue_bytes, copy_timeout_s=s.timeout_s,
                                 timings=self.timings)  # fmt: skip
        self.events = held_block_events(vllm_config, kv_cache_config, s) if scheduler else None
        logger.info("KVSieveConnector (%s) on %s, namespace %r, mode %s, model %s (%s), fingerprint %s",
                    role.name, s.store, s.namespace, s.mode, self.spec.name, self.spec.dtype,
                    self.spec.fingerprint.hex())  # fmt: skip

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a future cache miss, never lost data."""
        return False

    # -- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit that the sidecar holds, in whole vLLM blocks (one lookup/request)."""
        req_id = request.request_id
        if not self.tracker.known(req_id):
            prompt = list(request.prompt_token_ids or [])
            hit = None
            if len(prompt) > 1:
                # The last prompt token is always computed: its logits start the answer.
                hit = self.guard.call("lookup", lambda: self._lookup(prompt[:-1]))
            self.tracker.on_lookup(req_id, prompt, hit)
            if hit and self.events is not None:
                self.events.announce(request, 0, hit // self.block_size)
        return self.tracker.loadable_tokens(req_id, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remember a load that vLLM made room for."""
        self.tracker.on_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads and saves for the worker."""
        return KVSieveMetadata(self.tracker.plan(scheduled_requests(scheduler_output)))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its saves were copied out already, so vLLM may free its blocks now."""
        saved = self.tracker.saved_span(request.request_id)
        if saved is not None and self.events is not None:
            # Announced once the save was queued, not once the sidecar acknowledged it (the worker
            # cannot tell this process): a dropped save leaves a stale hint, costing a miss only.
            start, end = saved
            self.events.announce(request, start // self.block_size, end // self.block_size)
        self.tracker.forget(request.request_id)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The `BlockStored` events for blocks kvsieve holds since the last call (vLLM publishes
        them in its own stream, beside its GPU blocks' events)."""
        return self.events.take() if self.events is not None else ()

    def _lookup(self, tokens: list[int]) -> int:
        with self.timings.span("lookup", tokens=len(tokens)) as record:
            result = self.client.lookup(tokens, model=self.spec, namespace=self.settings.namespace)
            record["hit_tokens"] = int(result.num_tokens)
        return int(result.num_tokens)

    # -- worker side ----------------------------------------------------------------

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """On a GPU the per-layer hooks order our copies against attention: they must run between
        graph pieces, never be captured in a full CUDA graph (vLLM then switches to PIECEWISE)."""
        return True

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep vLLM's per-layer cache tensors, in the layout of the attention backend vLLM chose
        (checked against the model spec)."""
        config = self._vllm_config
        cache_layout = cache_layout_of(config, self._kv_cache_config, kv_caches, self.spec.head_dim)
        self.worker.register(kv_caches, cache_layout)
        logger.info("KVSieveConnector: KV cache on %s, %s", self.worker.device, cache_layout.describe())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Fetch this step's prefixes and write them into the paged cache (CPU), or queue their
        copies layer by layer on a side stream (CUDA)."""
        self.worker.start_load(self._plan().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """CUDA: this layer's attention waits for this layer's load only. CPU: all loads are done."""
        self.worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """CUDA: copy this layer's blocks of the step's saves out as soon as it is computed.
        CPU: nothing per layer, `wait_for_save` copies all layers after the forward pass."""
        if self.has_connector_metadata():
            self.worker.save_layer(layer_name, self._plan().saves)

    def wait_for_save(self) -> None:
        """Copy out the new full blocks of prompts whose prefill finished in this step and queue
        them for the background sender (the step does not wait for the sidecar)."""
        if self.has_connector_metadata():
            self.worker.save(self._plan().saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed: vLLM recomputes them."""
        return self.worker.take_failed_blocks()

    def shutdown(self) -> None:
        """Send the queued saves (within `timeout_s`), stop the sender, close the sidecar channel."""
        self.worker.close(self.settings.timeout_s)
        self.client.close()
        self.timings.close()

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KVSieveMetadata)
        return metadata.plan


def held_block_events(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings
) -> HeldBlockEvents | None:
    """The scheduler's event queue, or None where vLLM publishes no KV events (nothing would
    read them) or the `kv_events` setting turns them off."""
    events_config = vllm_config.kv_events_config
    if not settings.kv_events or events_config is None or not events_config.enable_kv_cache_events:
        return None
    return HeldBlockEvents(
        vllm_config.cache_config.block_size,
        hash_block_size=kv_cache_config.hash_block_size,
        capacity=settings.kv_events_queue,
    )


def scheduled_requests(output: SchedulerOutput) -> list[ScheduledRequest]:
    """The step's requests with their block-table changes, from vLLM's scheduler output."""
    scheduled = output.num_scheduled_tokens
    items = [
        ScheduledRequest(new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0),
                         tuple(new.block_ids[0]), replace=True)
        for new in output.scheduled_new_reqs
    ]  # fmt: skip
    cached = output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        new_blocks = cached.new_block_ids[i]
        items.append(
            ScheduledRequest(
                req_id,
                cached.num_computed_tokens[i],
                scheduled.get(req_id, 0),
                tuple(new_blocks[0]) if new_blocks is not None else (),
                replace=req_id in cached.resumed_req_ids,
            )
        )
    return items


def cache_layout_of(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor], head_dim: int
) -> layout.CacheLayout:
    """The layout of vLLM's cache, from the attention backend vLLM reports for its layers.

    Raises:
        InvalidInputError: an MLA or hybrid model, several backends, or a backend or cache shape
            the connector does not know (the message names them).
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    model = vllm_config.model_config.model
    groups = kv_cache_config.kv_cache_groups
    specs = [group.kv_cache_spec for group in groups]
    use_mla = getattr(vllm_config.model_config, "use_mla", False)
    if use_mla or any(isinstance(s, MLAAttentionSpec) for s in specs):
        raise InvalidInputError(
            f"KVSieveConnector does not support MLA models (multi-head latent attention, {model}): "
            "their KV cache is one latent vector per token, not keys and values per head"
        )
    if len(groups) != 1 or not isinstance(specs[0], FullAttentionSpec):
        kinds = sorted({type(s).__name__ for s in specs})
        raise InvalidInputError(
            f"KVSieveConnector supports models whose layers all use full attention; {model} is a hybrid "
            f"model ({len(groups)} KV cache groups: {', '.join(kinds)})"
        )
    backends = get_current_attn_backends(vllm_config, list(kv_caches))
    if len(backends) != 1:
        raise InvalidInputError(
            f"KVSieveConnector needs one attention backend for all layers, vLLM uses "
            f"{sorted(b.get_name() for b in backends)}"
        )
    physical = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout or ""
    return layout.detect(
        backends[0],
        head_dim,
        head_dim_v=getattr(specs[0], "head_size_v", None),
        physical=str(physical),
        sample=next(iter(kv_caches.values())),
    )
