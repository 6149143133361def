"""Block keys match the vectors in docs/keys.md, in this and in a fresh process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import InvalidInputError
from kvstore.format.block_meta import layered_layout_version
from kvstore.keys import as_token_array, block_keys, chunk_key, namespace_digest
from kvstore.model import ModelSpec

DOC = Path(__file__).resolve().parent.parent / "docs" / "keys.md"


def _vectors() -> dict:
    text = DOC.read_text()
    block = re.search(r"```json\n(.*?)```", text, re.S)
    assert block, "docs/keys.md has no JSON test-vector block"
    return json.loads(block.group(1))


def test_fingerprint_and_namespace_vectors() -> None:
    vectors = _vectors()
    model = ModelSpec(**vectors["model"])
    assert model.fingerprint.hex() == vectors["fingerprint"]
    for name, digest in vectors["namespaces"].items():
        assert namespace_digest(name).hex() == digest


@pytest.mark.parametrize("index", [0, 1])
def test_block_key_chain_vectors(index: int) -> None:
    vectors = _vectors()
    chain = vectors["chains"][index]
    fp = ModelSpec(**vectors["model"]).fingerprint
    tokens = as_token_array(chain["tokens"])
    keys = block_keys(tokens, chain["block_tokens"], fp, namespace_digest(chain["namespace"]))
    assert [k.hex() for k in keys] == chain["keys"]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_layered_chunk_key_vectors(index: int) -> None:
    vector = _vectors()["layered_chunk_keys"][index]
    version = layered_layout_version(vector["layer_chunk_tokens"], vector.get("packed", False))
    assert version == vector["layout_version"]
    key = chunk_key(bytes.fromhex(vector["block_key"]), version, vector["record_index"])
    assert key.hex() == vector["chunk_key"]


def test_keys_identical_in_a_fresh_process() -> None:
    code = (
        "import numpy as np;from kvstore.keys import block_keys, namespace_digest;"
        "keys = block_keys(np.arange(64, dtype=np.uint32), 16, bytes(16), namespace_digest('x'));"
        "print(keys[-1].hex())"
    )
    here = block_keys(np.arange(64, dtype=np.uint32), 16, bytes(16), namespace_digest("x"))[-1].hex()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_every_input_changes_the_key() -> None:
    tokens = np.arange(32, dtype=np.uint32)
    base = block_keys(tokens, 16, bytes(16), namespace_digest("a"))
    other_tokens = tokens.copy()
    other_tokens[20] += 1
    assert block_keys(other_tokens, 16, bytes(16), namespace_digest("a"))[0] == base[0]
    assert block_keys(other_tokens, 16, bytes(16), namespace_digest("a"))[1] != base[1]
    assert block_keys(tokens, 16, b"\x01" * 16, namespace_digest("a"))[0] != base[0]
    assert block_keys(tokens, 16, bytes(16), namespace_digest("b"))[0] != base[0]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [([1.5, 2.0], "integers"), ([-1, 2], r"\[0, "), ([[1, 2]], "1-D"), ([2**33], r"\[0, ")],
)
def test_bad_tokens_are_rejected(tokens: list, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        as_token_array(tokens)


@pytest.mark.parametrize("namespace", ["", "x" * 257])
def test_bad_namespace_is_rejected(namespace: str) -> None:
    with pytest.raises(InvalidInputError, match="namespace"):
        namespace_digest(namespace)
