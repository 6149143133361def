"""The `ModelSpec` of the model vLLM serves: the identity every block key includes.

Built exactly as our own engine builds it (`engine_adapter.runner.model.spec_from_config`):
the model directory's name, its HF config (layers, KV heads, head size, rope), a
digest of its weight files and tokenizer, and the dtype of the KV cache. Nothing
comes from process-local state, so a restarted vLLM, a second vLLM process, or
our engine serving the same weights compute the same keys.

The KV dtype is part of the identity: vLLM on CPU runs a float32 checkpoint in
bfloat16 by default, so its blocks never mix with our engine's float16 blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine_adapter.runner import spec_from_config
from engine_adapter.vllm.layout import dtype_name
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec


def model_directory(model: str, revision: str | None = None) -> Path:
    """The local directory of `model`: a path as given, or a hub name already in the local HF cache.

    Raises:
        InvalidInputError: neither (the weights digest needs the files on disk).
    """
    path = Path(model).expanduser()
    if (path / "config.json").exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:
        raise InvalidInputError(
            f"KVSieveConnector needs the model's files on disk to fingerprint them; {model!r} is "
            f"neither a directory with config.json nor in the local Hugging Face cache ({exc})"
        ) from exc


def kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype vLLM keeps KV in: the model's dtype unless the cache dtype says otherwise.

    Raises:
        InvalidInputError: a quantised (fp8) cache, which kvsieve does not store.
    """
    if cache_dtype != "auto":
        raise InvalidInputError(
            f"KVSieveConnector needs kv_cache_dtype 'auto' (KV in the model dtype), got {cache_dtype!r}"
        )
    return model_dtype


def vllm_model_spec(vllm_config: Any) -> ModelSpec:
    """The `ModelSpec` of the model and KV dtype configured in a `VllmConfig`."""
    model_config = vllm_config.model_config
    source = model_directory(model_config.model, getattr(model_config, "revision", None))
    dtype = kv_cache_dtype(vllm_config.cache_config.cache_dtype, model_config.dtype)
    from transformers import AutoConfig

    # The HF config as our engine reads it (vLLM's own copy may be patched for its kernels).
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    return spec_from_config(config, source, dtype_name(dtype))
