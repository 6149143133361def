"""Half precision (`--dtype`) and the full load through the staged device path, on the real model.

fp16 and bf16 also run on the CPU (slower): the model computes in them and keeps its KV in them
(an fp32 model keeps fp16 KV); the KV dtype is part of the fingerprint, so bf16 KV is never loaded
where fp16 KV is expected, nor the other way.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.engine import Engine
from engine_adapter.runner.model import load_model, resolve_dtype
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.store.tiered import TieredStore

QUESTION = "Which colour was the sea, according to the log?"
CONTEXT = (
    "The lighthouse keeper wrote in his log every evening: the wind, the ships, the colour "
    "of the sea and the names of the birds that rested on the rail. "
) * 6


def test_auto_is_fp32_on_the_cpu_and_the_checkpoints_half_on_cuda(tmp_path: Path) -> None:
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.bfloat16  # no checkpoint to read: half all the same
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    assert resolve_dtype("auto", cuda, tmp_path) == torch.float16
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')
    assert resolve_dtype("auto", cuda, tmp_path) == torch.bfloat16  # an fp32 checkpoint runs in bf16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(InvalidInputError, match="--dtype must be one of auto, float32, float16, bfloat16"):
        resolve_dtype("half", cuda)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    config = StoreConfig(data_dir=tmp_path / "data", block_tokens=32, chunk_tokens=8, host_arena=True)
    with TieredStore(config) as s:
        yield s


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_keeps_kv_in_its_dtype_and_loads_it(store: TieredStore, dtype: str) -> None:
    lm = load_model(quiet=True, dtype=dtype)
    assert lm.dtype == getattr(torch, dtype) and lm.spec.dtype == dtype
    # bf16 KV is never loaded where fp16 KV is expected; an fp32 model keeps its KV in fp16 too, so
    # fp16 and fp32 models share theirs (fp32-computed KV rounded to fp16 is the better of the two)
    same = lm.spec.fingerprint == load_model(quiet=True).spec.fingerprint
    assert same == (dtype == "float16")
    engine = Engine(lm, store)
    ids = engine.encode(f"{CONTEXT}\n\n{QUESTION}")
    recomputed = Engine(lm).prefill(ids).logits.float()
    first = engine.prefill(ids)
    assert first.stored_blocks == len(ids) // 32
    second = engine.prefill(ids)
    assert second.loaded_tokens == second.matched_tokens == (len(ids) - 1) // 32 * 32
    assert int(second.logits.argmax()) == int(recomputed.argmax())
    kv, _ = engine.analyze(ids[: second.matched_tokens])
    _, _, loaded = store.load_arrays(ids[: second.matched_tokens], model=lm.spec)
    assert kv.dtype.name == loaded.dtype.name == dtype
    np.testing.assert_array_equal(loaded.view(np.uint16), kv.view(np.uint16))  # bit-exact round trip


@pytest.mark.model
@pytest.mark.slow
def test_the_staged_full_load_gives_the_plain_paths_logits_with_no_host_copy(store: TieredStore) -> None:
    lm = load_model(quiet=True)
    plain = Engine(lm, store)
    ids = plain.encode(f"{CONTEXT}\n\n{QUESTION}")
    plain.prefill(ids)  # stores the prefix
    expected = plain.prefill(ids).logits
    staged = Engine(lm, store, transfer=KVTransfer(torch.device("cpu"), staging=True))
    got = staged.prefill(ids)
    assert got.loaded_tokens == got.matched_tokens > 0
    counts = staged.transfer.last_counts
    assert counts is not None and counts.staged_bytes == 0 and counts.device_copies > 0
    assert torch.equal(got.logits, expected)
