from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelSpec(_message.Message):
    __slots__ = ("name", "num_layers", "num_kv_heads", "head_dim", "dtype", "rope", "weights_digest", "tokenizer_digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    rope: str
    weights_digest: str
    tokenizer_digest: str
    def __init__(self, name: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., rope: _Optional[str] = ..., weights_digest: _Optional[str] = ..., tokenizer_digest: _Optional[str] = ...) -> None: ...

class RequestContext(_message.Message):
    __slots__ = ("namespace", "model")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model: ModelSpec
    def __init__(self, namespace: _Optional[str] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("ctx", "tokens", "tokens_u32le")
    CTX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_U32LE_FIELD_NUMBER: _ClassVar[int]
    ctx: RequestContext
    tokens: _containers.RepeatedScalarFieldContainer[int]
    tokens_u32le: bytes
    def __init__(self, ctx: _Optional[_Union[RequestContext, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., tokens_u32le: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_tokens", "num_blocks", "memory_blocks", "packed_tokens")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    num_blocks: int
    memory_blocks: int
    packed_tokens: bool
    def __init__(self, num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., memory_blocks: _Optional[int] = ..., packed_tokens: _Optional[bool] = ...) -> None: ...

class LookupManyRequest(_message.Message):
    __slots__ = ("ctx", "tokens_u32le", "list_tokens")
    CTX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_U32LE_FIELD_NUMBER: _ClassVar[int]
    LIST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ctx: RequestContext
    tokens_u32le: bytes
    list_tokens: int
    def __init__(self, ctx: _Optional[_Union[RequestContext, _Mapping]] = ..., tokens_u32le: _Optional[bytes] = ..., list_tokens: _Optional[int] = ...) -> None: ...

class LookupManyResponse(_message.Message):
    __slots__ = ("leading_cached",)
    LEADING_CACHED_FIELD_NUMBER: _ClassVar[int]
    leading_cached: int
    def __init__(self, leading_cached: _Optional[int] = ...) -> None: ...

class LoadManyRequest(_message.Message):
    __slots__ = ("ctx", "tokens_u32le", "list_tokens", "arena_id")
    CTX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_U32LE_FIELD_NUMBER: _ClassVar[int]
    LIST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    ctx: RequestContext
    tokens_u32le: bytes
    list_tokens: int
    arena_id: str
    def __init__(self, ctx: _Optional[_Union[RequestContext, _Mapping]] = ..., tokens_u32le: _Optional[bytes] = ..., list_tokens: _Optional[int] = ..., arena_id: _Optional[str] = ...) -> None: ...

class LoadManyResponse(_message.Message):
    __slots__ = ("index", "num_tokens", "shm", "kv")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_tokens: int
    shm: bool
    kv: bytes
    def __init__(self, index: _Optional[int] = ..., num_tokens: _Optional[int] = ..., shm: _Optional[bool] = ..., kv: _Optional[bytes] = ...) -> None: ...

class StoreHeader(_message.Message):
    __slots__ = ("ctx", "tokens", "scores", "kv_start", "arena_id")
    CTX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    KV_START_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    ctx: RequestContext
    tokens: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    kv_start: int
    arena_id: str
    def __init__(self, ctx: _Optional[_Union[RequestContext, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., kv_start: _Optional[int] = ..., arena_id: _Optional[str] = ...) -> None: ...

class KVSlice(_message.Message):
    __slots__ = ("start_token", "num_tokens", "data")
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    start_token: int
    num_tokens: int
    data: bytes
    def __init__(self, start_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("header", "slice")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    header: StoreHeader
    slice: KVSlice
    def __init__(self, header: _Optional[_Union[StoreHeader, _Mapping]] = ..., slice: _Optional[_Union[KVSlice, _Mapping]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("num_tokens", "new_blocks", "bytes_written")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    new_blocks: int
    bytes_written: int
    def __init__(self, num_tokens: _Optional[int] = ..., new_blocks: _Optional[int] = ..., bytes_written: _Optional[int] = ...) -> None: ...

class CreateArenaRequest(_message.Message):
    __slots__ = ("namespace", "nbytes", "client_pid")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    nbytes: int
    client_pid: int
    def __init__(self, namespace: _Optional[str] = ..., nbytes: _Optional[int] = ..., client_pid: _Optional[int] = ...) -> None: ...

class CreateArenaResponse(_message.Message):
    __slots__ = ("arena_id", "server_pid", "fd", "nbytes", "inode", "accepts_store")
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_STORE_FIELD_NUMBER: _ClassVar[int]
    arena_id: str
    server_pid: int
    fd: int
    nbytes: int
    inode: int
    accepts_store: bool
    def __init__(self, arena_id: _Optional[str] = ..., server_pid: _Optional[int] = ..., fd: _Optional[int] = ..., nbytes: _Optional[int] = ..., inode: _Optional[int] = ..., accepts_store: _Optional[bool] = ...) -> None: ...

class ReleaseSegmentRequest(_message.Message):
    __slots__ = ("shm_name", "namespace", "arena_id")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    namespace: str
    arena_id: str
    def __init__(self, shm_name: _Optional[str] = ..., namespace: _Optional[str] = ..., arena_id: _Optional[str] = ...) -> None: ...

class ReleaseSegmentResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("ctx", "tokens", "budget", "budget_tokens", "shm_name", "shm_bytes", "arena_id", "budget_mode", "coverage", "min_fraction", "max_fraction", "tokens_u32le", "packed_positions", "shm_by_position")
    CTX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_MODE_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    MIN_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MAX_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_U32LE_FIELD_NUMBER: _ClassVar[int]
    PACKED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SHM_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    ctx: RequestContext
    tokens: _containers.RepeatedScalarFieldContainer[int]
    budget: float
    budget_tokens: int
    shm_name: str
    shm_bytes: int
    arena_id: str
    budget_mode: str
    coverage: float
    min_fraction: float
    max_fraction: float
    tokens_u32le: bytes
    packed_positions: bool
    shm_by_position: bool
    def __init__(self, ctx: _Optional[_Union[RequestContext, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., budget: _Optional[float] = ..., budget_tokens: _Optional[int] = ..., shm_name: _Optional[str] = ..., shm_bytes: _Optional[int] = ..., arena_id: _Optional[str] = ..., budget_mode: _Optional[str] = ..., coverage: _Optional[float] = ..., min_fraction: _Optional[float] = ..., max_fraction: _Optional[float] = ..., tokens_u32le: _Optional[bytes] = ..., packed_positions: _Optional[bool] = ..., shm_by_position: _Optional[bool] = ...) -> None: ...

class LoadHeader(_message.Message):
    __slots__ = ("matched_tokens", "selected_tokens", "shm", "packed_tokens", "shm_by_position")
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SELECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHM_BY_POSITION_FIELD_NUMBER: _ClassVar[int]
    matched_tokens: int
    selected_tokens: int
    shm: bool
    packed_tokens: bool
    shm_by_position: bool
    def __init__(self, matched_tokens: _Optional[int] = ..., selected_tokens: _Optional[int] = ..., shm: _Optional[bool] = ..., packed_tokens: _Optional[bool] = ..., shm_by_position: _Optional[bool] = ...) -> None: ...

class ShmRef(_message.Message):
    __slots__ = ("slot", "num_tokens")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    num_tokens: int
    def __init__(self, slot: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("block_index", "chunk_index", "positions", "data", "shm", "tier", "positions_u32le")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_U32LE_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    chunk_index: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shm: ShmRef
    tier: str
    positions_u32le: bytes
    def __init__(self, block_index: _Optional[int] = ..., chunk_index: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ..., tier: _Optional[str] = ..., positions_u32le: _Optional[bytes] = ...) -> None: ...

class ChunkBatch(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ...) -> None: ...

class LoadTrailer(_message.Message):
    __slots__ = ("num_tokens", "bytes_read", "read_amplification", "delivered_tokens", "delivered_fraction", "read_fraction", "estimated_coverage")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    READ_AMPLIFICATION_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    READ_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_COVERAGE_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    bytes_read: int
    read_amplification: float
    delivered_tokens: int
    delivered_fraction: float
    read_fraction: float
    estimated_coverage: float
    def __init__(self, num_tokens: _Optional[int] = ..., bytes_read: _Optional[int] = ..., read_amplification: _Optional[float] = ..., delivered_tokens: _Optional[int] = ..., delivered_fraction: _Optional[float] = ..., read_fraction: _Optional[float] = ..., estimated_coverage: _Optional[float] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "batch")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    header: LoadHeader
    chunk: Chunk
    trailer: LoadTrailer
    batch: ChunkBatch
    def __init__(self, header: _Optional[_Union[LoadHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., trailer: _Optional[_Union[LoadTrailer, _Mapping]] = ..., batch: _Optional[_Union[ChunkBatch, _Mapping]] = ...) -> None: ...

class ReportScoresRequest(_message.Message):
    __slots__ = ("ctx", "tokens", "scores", "source")
    CTX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ctx: RequestContext
    tokens: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    source: str
    def __init__(self, ctx: _Optional[_Union[RequestContext, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ..., source: _Optional[str] = ...) -> None: ...

class ReportScoresResponse(_message.Message):
    __slots__ = ("blocks_updated",)
    BLOCKS_UPDATED_FIELD_NUMBER: _ClassVar[int]
    blocks_updated: int
    def __init__(self, blocks_updated: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("ctx", "tokens", "ttl_s")
    CTX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ctx: RequestContext
    tokens: _containers.RepeatedScalarFieldContainer[int]
    ttl_s: float
    def __init__(self, ctx: _Optional[_Union[RequestContext, _Mapping]] = ..., tokens: _Optional[_Iterable[int]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("lease_id", "num_blocks", "ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    num_blocks: int
    ttl_s: float
    def __init__(self, lease_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("name", "used_bytes", "capacity_bytes", "num_blocks", "num_chunks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    used_bytes: int
    capacity_bytes: int
    num_blocks: int
    num_chunks: int
    def __init__(self, name: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("counters", "tiers", "num_blocks", "active_leases", "read_amplification")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    READ_AMPLIFICATION_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierUsage]
    num_blocks: int
    active_leases: int
    read_amplification: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ..., tiers: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., num_blocks: _Optional[int] = ..., active_leases: _Optional[int] = ..., read_amplification: _Optional[_Iterable[float]] = ...) -> None: ...

class LayersOpen(_message.Message):
    __slots__ = ("ctx", "tokens_u32le")
    CTX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_U32LE_FIELD_NUMBER: _ClassVar[int]
    ctx: RequestContext
    tokens_u32le: bytes
    def __init__(self, ctx: _Optional[_Union[RequestContext, _Mapping]] = ..., tokens_u32le: _Optional[bytes] = ...) -> None: ...

class LayerRead(_message.Message):
    __slots__ = ("layer", "summary", "chunks_u32le")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_U32LE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    summary: bool
    chunks_u32le: bytes
    def __init__(self, layer: _Optional[int] = ..., summary: _Optional[bool] = ..., chunks_u32le: _Optional[bytes] = ...) -> None: ...

class LayersRequest(_message.Message):
    __slots__ = ("open", "read")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    open: LayersOpen
    read: LayerRead
    def __init__(self, open: _Optional[_Union[LayersOpen, _Mapping]] = ..., read: _Optional[_Union[LayerRead, _Mapping]] = ...) -> None: ...

class LayersHeader(_message.Message):
    __slots__ = ("matched_tokens", "chunk_tokens", "num_layers", "prefix_bytes", "summary_bytes")
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_BYTES_FIELD_NUMBER: _ClassVar[int]
    matched_tokens: int
    chunk_tokens: int
    num_layers: int
    prefix_bytes: int
    summary_bytes: int
    def __init__(self, matched_tokens: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., num_layers: _Optional[int] = ..., prefix_bytes: _Optional[int] = ..., summary_bytes: _Optional[int] = ...) -> None: ...

class LayerSummary(_message.Message):
    __slots__ = ("layer", "kv_heads", "num_tokens", "head_dim", "bits", "group_tokens", "codes", "low_f16", "step_f16")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    GROUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    LOW_F16_FIELD_NUMBER: _ClassVar[int]
    STEP_F16_FIELD_NUMBER: _ClassVar[int]
    layer: int
    kv_heads: int
    num_tokens: int
    head_dim: int
    bits: int
    group_tokens: int
    codes: bytes
    low_f16: bytes
    step_f16: bytes
    def __init__(self, layer: _Optional[int] = ..., kv_heads: _Optional[int] = ..., num_tokens: _Optional[int] = ..., head_dim: _Optional[int] = ..., bits: _Optional[int] = ..., group_tokens: _Optional[int] = ..., codes: _Optional[bytes] = ..., low_f16: _Optional[bytes] = ..., step_f16: _Optional[bytes] = ...) -> None: ...

class LayerData(_message.Message):
    __slots__ = ("layer", "positions_u32le", "kv")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_U32LE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    layer: int
    positions_u32le: bytes
    kv: bytes
    def __init__(self, layer: _Optional[int] = ..., positions_u32le: _Optional[bytes] = ..., kv: _Optional[bytes] = ...) -> None: ...

class LayersResponse(_message.Message):
    __slots__ = ("header", "summary", "data", "bytes_read", "delivered_tokens")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    header: LayersHeader
    summary: LayerSummary
    data: LayerData
    bytes_read: int
    delivered_tokens: int
    def __init__(self, header: _Optional[_Union[LayersHeader, _Mapping]] = ..., summary: _Optional[_Union[LayerSummary, _Mapping]] = ..., data: _Optional[_Union[LayerData, _Mapping]] = ..., bytes_read: _Optional[int] = ..., delivered_tokens: _Optional[int] = ...) -> None: ...
