from protos import engine_pb2 as _engine_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MissReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MISS_REASON_UNSPECIFIED: _ClassVar[MissReason]
    MISS_REASON_EMPTY: _ClassVar[MissReason]
    MISS_REASON_DIVERGED: _ClassVar[MissReason]
    MISS_REASON_BOUNDARY_REFUSED: _ClassVar[MissReason]
    MISS_REASON_ENGINE_RESTARTED: _ClassVar[MissReason]
    MISS_REASON_TOO_SHORT: _ClassVar[MissReason]
    MISS_REASON_DISABLED: _ClassVar[MissReason]
    MISS_REASON_WINDOW: _ClassVar[MissReason]

class InsertRefusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSERT_REFUSAL_UNSPECIFIED: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_DISABLED: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_POSITION_MISMATCH: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_CONTENT_MISMATCH: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_PREPARED_INPUT: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_CLONE_REFUSED: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_DUPLICATE: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_INVALID_SNAPSHOT: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_EVICTED: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_INVALID_KEY: _ClassVar[InsertRefusal]
    INSERT_REFUSAL_OVER_BUDGET: _ClassVar[InsertRefusal]

class CacheEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_EVENT_KIND_UNSPECIFIED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_STORED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_EVICTED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_CLEARED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_DROPPED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_GAP: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_SYNCED: _ClassVar[CacheEventKind]
    CACHE_EVENT_KIND_MOVED: _ClassVar[CacheEventKind]
MISS_REASON_UNSPECIFIED: MissReason
MISS_REASON_EMPTY: MissReason
MISS_REASON_DIVERGED: MissReason
MISS_REASON_BOUNDARY_REFUSED: MissReason
MISS_REASON_ENGINE_RESTARTED: MissReason
MISS_REASON_TOO_SHORT: MissReason
MISS_REASON_DISABLED: MissReason
MISS_REASON_WINDOW: MissReason
INSERT_REFUSAL_UNSPECIFIED: InsertRefusal
INSERT_REFUSAL_DISABLED: InsertRefusal
INSERT_REFUSAL_POSITION_MISMATCH: InsertRefusal
INSERT_REFUSAL_CONTENT_MISMATCH: InsertRefusal
INSERT_REFUSAL_PREPARED_INPUT: InsertRefusal
INSERT_REFUSAL_CLONE_REFUSED: InsertRefusal
INSERT_REFUSAL_DUPLICATE: InsertRefusal
INSERT_REFUSAL_INVALID_SNAPSHOT: InsertRefusal
INSERT_REFUSAL_EVICTED: InsertRefusal
INSERT_REFUSAL_INVALID_KEY: InsertRefusal
INSERT_REFUSAL_OVER_BUDGET: InsertRefusal
CACHE_EVENT_KIND_UNSPECIFIED: CacheEventKind
CACHE_EVENT_KIND_STORED: CacheEventKind
CACHE_EVENT_KIND_EVICTED: CacheEventKind
CACHE_EVENT_KIND_CLEARED: CacheEventKind
CACHE_EVENT_KIND_DROPPED: CacheEventKind
CACHE_EVENT_KIND_GAP: CacheEventKind
CACHE_EVENT_KIND_SYNCED: CacheEventKind
CACHE_EVENT_KIND_MOVED: CacheEventKind

class LookupRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "text", "cache_salt")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tokens: _engine_pb2.TokenIds
    text: _engine_pb2.TextInput
    cache_salt: str
    def __init__(self, namespace: _Optional[str] = ..., tokens: _Optional[_Union[_engine_pb2.TokenIds, _Mapping]] = ..., text: _Optional[_Union[_engine_pb2.TextInput, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("session", "reused", "tokens", "reason", "diverged_at", "engine")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_AT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    session: str
    reused: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    reason: MissReason
    diverged_at: int
    engine: str
    def __init__(self, session: _Optional[str] = ..., reused: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., reason: _Optional[_Union[MissReason, str]] = ..., diverged_at: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class InsertRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "session", "metadata", "engine", "cache_salt")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    session: str
    metadata: _containers.ScalarMap[str, str]
    engine: str
    cache_salt: str
    def __init__(self, namespace: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., session: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., engine: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("stored", "reason")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    reason: InsertRefusal
    def __init__(self, stored: _Optional[bool] = ..., reason: _Optional[_Union[InsertRefusal, str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("entries", "max_entries", "hits", "misses", "inserts", "dropped_on_restart", "engine_instance_id", "policy", "reused_positions", "refusals", "max_positions", "positions", "engine_share", "pressure_evictions", "pressure_retries", "reclaimed", "routing", "engines", "snapshot_dir", "misses_by_reason", "bytes_held", "max_bytes")
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MissesByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    INSERTS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_ON_RESTART_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REUSED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SHARE_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_RETRIES_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DIR_FIELD_NUMBER: _ClassVar[int]
    MISSES_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    max_entries: int
    hits: int
    misses: int
    inserts: int
    dropped_on_restart: int
    engine_instance_id: str
    policy: str
    reused_positions: int
    refusals: _containers.ScalarMap[str, int]
    max_positions: int
    positions: int
    engine_share: float
    pressure_evictions: int
    pressure_retries: int
    reclaimed: int
    routing: str
    engines: _containers.RepeatedCompositeFieldContainer[EngineStats]
    snapshot_dir: SnapshotDirStats
    misses_by_reason: _containers.ScalarMap[str, int]
    bytes_held: int
    max_bytes: int
    def __init__(self, entries: _Optional[int] = ..., max_entries: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., inserts: _Optional[int] = ..., dropped_on_restart: _Optional[int] = ..., engine_instance_id: _Optional[str] = ..., policy: _Optional[str] = ..., reused_positions: _Optional[int] = ..., refusals: _Optional[_Mapping[str, int]] = ..., max_positions: _Optional[int] = ..., positions: _Optional[int] = ..., engine_share: _Optional[float] = ..., pressure_evictions: _Optional[int] = ..., pressure_retries: _Optional[int] = ..., reclaimed: _Optional[int] = ..., routing: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[EngineStats, _Mapping]]] = ..., snapshot_dir: _Optional[_Union[SnapshotDirStats, _Mapping]] = ..., misses_by_reason: _Optional[_Mapping[str, int]] = ..., bytes_held: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class SnapshotDirStats(_message.Message):
    __slots__ = ("files", "bytes", "max_bytes", "written", "dropped", "failed", "restored", "refused", "evicted", "discarded")
    FILES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    files: int
    bytes: int
    max_bytes: int
    written: int
    dropped: int
    failed: int
    restored: int
    refused: int
    evicted: int
    discarded: int
    def __init__(self, files: _Optional[int] = ..., bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., written: _Optional[int] = ..., dropped: _Optional[int] = ..., failed: _Optional[int] = ..., restored: _Optional[int] = ..., refused: _Optional[int] = ..., evicted: _Optional[int] = ..., discarded: _Optional[int] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("engine", "instance_id", "fingerprint", "routable", "entries", "positions", "hits", "misses", "in_flight", "load", "routed", "load_guarded", "moves_in", "moves_out", "move_refusals")
    class MoveRefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROUTABLE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_GUARDED_FIELD_NUMBER: _ClassVar[int]
    MOVES_IN_FIELD_NUMBER: _ClassVar[int]
    MOVES_OUT_FIELD_NUMBER: _ClassVar[int]
    MOVE_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    engine: str
    instance_id: str
    fingerprint: str
    routable: bool
    entries: int
    positions: int
    hits: int
    misses: int
    in_flight: int
    load: int
    routed: int
    load_guarded: int
    moves_in: int
    moves_out: int
    move_refusals: _containers.ScalarMap[str, int]
    def __init__(self, engine: _Optional[str] = ..., instance_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., routable: _Optional[bool] = ..., entries: _Optional[int] = ..., positions: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., in_flight: _Optional[int] = ..., load: _Optional[int] = ..., routed: _Optional[int] = ..., load_guarded: _Optional[int] = ..., moves_in: _Optional[int] = ..., moves_out: _Optional[int] = ..., move_refusals: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class GatewayGenerateRequest(_message.Message):
    __slots__ = ("namespace", "tokens", "text", "config", "skip_insert", "metadata", "cache_salt")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SKIP_INSERT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tokens: _engine_pb2.TokenIds
    text: _engine_pb2.TextInput
    config: _engine_pb2.GenerationConfig
    skip_insert: bool
    metadata: _containers.ScalarMap[str, str]
    cache_salt: str
    def __init__(self, namespace: _Optional[str] = ..., tokens: _Optional[_Union[_engine_pb2.TokenIds, _Mapping]] = ..., text: _Optional[_Union[_engine_pb2.TextInput, _Mapping]] = ..., config: _Optional[_Union[_engine_pb2.GenerationConfig, _Mapping]] = ..., skip_insert: _Optional[bool] = ..., metadata: _Optional[_Mapping[str, str]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class CacheEventsRequest(_message.Message):
    __slots__ = ("replay",)
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    replay: bool
    def __init__(self, replay: _Optional[bool] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("kind", "sequence", "engine", "engine_instance_id", "time", "namespace", "positions", "digest", "replayed", "missed", "replica", "source_engine")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    MISSED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ENGINE_FIELD_NUMBER: _ClassVar[int]
    kind: CacheEventKind
    sequence: int
    engine: str
    engine_instance_id: str
    time: float
    namespace: str
    positions: int
    digest: bytes
    replayed: bool
    missed: int
    replica: str
    source_engine: str
    def __init__(self, kind: _Optional[_Union[CacheEventKind, str]] = ..., sequence: _Optional[int] = ..., engine: _Optional[str] = ..., engine_instance_id: _Optional[str] = ..., time: _Optional[float] = ..., namespace: _Optional[str] = ..., positions: _Optional[int] = ..., digest: _Optional[bytes] = ..., replayed: _Optional[bool] = ..., missed: _Optional[int] = ..., replica: _Optional[str] = ..., source_engine: _Optional[str] = ...) -> None: ...
