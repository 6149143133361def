"""The model runner: a real transformer computing prompts on top of prefix KV from kvsieve.

Its modules, by role: `model` (loading SmolLM2 or any Llama shape, `--dtype`), `engine`
(`Engine`, the facade: generate, prefill, decode, score), `prefill` with `layered`,
`layered_policy`, `topup` and `split` (the ways a prefix is loaded and computed on), `choice`
with `plans`, `costs`, `measured` and `disk_probe` (which of those ways a request runs, from what
each measured on this device), `device` and `upload` (how loaded KV reaches the model's device),
`saver` (new blocks stored off the request), `cache`, `batchcache`, `array_layers` and
`attention` (the model's KV and attention hooks), `decode`, `sampling`, `chat` and `batch`
(turning logits into answers).

This package's face is the names below: the integrations above it (the DSL, the vLLM
connector, SGLang's storage), the engine server and the commands import the runner through
them only (tests/test_layering.py checks). Each name is imported on first use, so that
importing the face (the DSL's planner needs `Sampling`) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine_adapter.runner.batchcache import BatchCache as BatchCache
    from engine_adapter.runner.cache import share_cache as share_cache
    from engine_adapter.runner.chat import Conversation as Conversation
    from engine_adapter.runner.choice import SplitPlan as SplitPlan
    from engine_adapter.runner.decode import Completion as Completion
    from engine_adapter.runner.decode import Sampler as Sampler
    from engine_adapter.runner.device import resolve_device as resolve_device
    from engine_adapter.runner.engine import Engine as Engine
    from engine_adapter.runner.engine import GenerateResult as GenerateResult
    from engine_adapter.runner.layered import LayeredReport as LayeredReport
    from engine_adapter.runner.model import (
        LoadedModel as LoadedModel,
    )
    from engine_adapter.runner.model import (
        cache_dir as cache_dir,
    )
    from engine_adapter.runner.model import (
        load_model as load_model,
    )
    from engine_adapter.runner.model import (
        spec_from_config as spec_from_config,
    )
    from engine_adapter.runner.sampling import (
        GENERATE_NO_REPEAT_NGRAM as GENERATE_NO_REPEAT_NGRAM,
    )
    from engine_adapter.runner.sampling import (
        Sampling as Sampling,
    )

#: Each name of the face and the module of this package that defines it.
FACE = {
    "BatchCache": "batchcache",
    "share_cache": "cache",
    "Conversation": "chat",
    "SplitPlan": "choice",
    "Completion": "decode",
    "Sampler": "decode",
    "resolve_device": "device",
    "Engine": "engine",
    "GenerateResult": "engine",
    "LayeredReport": "layered",
    "LoadedModel": "model",
    "cache_dir": "model",
    "load_model": "model",
    "spec_from_config": "model",
    "GENERATE_NO_REPEAT_NGRAM": "sampling",
    "Sampling": "sampling",
}
__all__ = sorted(FACE)


def __getattr__(name: str) -> object:
    """A name of the face, imported from its module on first use (PEP 562)."""
    home = FACE.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"engine_adapter.runner.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
