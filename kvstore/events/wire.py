"""vLLM's KV-event wire format (vllm/distributed/kv_events.py of vllm 0.32.0), byte for byte.

A message is three ZMQ frames: the topic (UTF-8, may be empty), the sequence number (8 bytes,
big-endian, unsigned) and a msgpack payload. The payload is an `EventBatch`, encoded as an array
`[ts, [event, ...], data_parallel_rank]`; each event is a map tagged `"type": <class name>` whose
fields equal to their default are left out. The classes below repeat vLLM's field names, order
and options so that msgspec encodes them to the very bytes vLLM's own classes give
(tests/test_kv_events.py compares the two); only the fields kvsieve fills are declared, which
is the same thing on the wire because omitted defaults are never written.

A replay request is `[b"", start_seq (8 bytes)]` on a DEALER (or REQ) socket; each answer is
`[b"", topic, seq, payload]`, and the end is `[b"", b"", END_SEQ, b""]`.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_SEQ = struct.Struct(">Q")


class BlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Blocks now held: `block_hashes[i]` covers `token_ids[i*block_size:(i+1)*block_size]`."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Blocks no longer held in `medium`."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Forget everything this publisher said before (a snapshot follows)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's payload."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def encode_seq(seq: int) -> bytes:
    """The sequence frame: 8 bytes, big-endian."""
    return _SEQ.pack(seq)


def decode_seq(frame: bytes) -> int:
    """Read a sequence frame (raises ValueError unless it is 8 bytes)."""
    if len(frame) != _SEQ.size:
        raise ValueError(f"a sequence frame is {_SEQ.size} bytes, got {len(frame)}")
    return int(_SEQ.unpack(frame)[0])
