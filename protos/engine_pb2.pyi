from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CloneRefusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLONE_REFUSAL_UNSPECIFIED: _ClassVar[CloneRefusal]
    CLONE_REFUSAL_POSITION: _ClassVar[CloneRefusal]
    CLONE_REFUSAL_BOUNDARY: _ClassVar[CloneRefusal]
    CLONE_REFUSAL_CONTENT_MISMATCH: _ClassVar[CloneRefusal]
    CLONE_REFUSAL_PREPARED_INPUT: _ClassVar[CloneRefusal]
    CLONE_REFUSAL_SOURCE_UNUSABLE: _ClassVar[CloneRefusal]
    CLONE_REFUSAL_STOPPING: _ClassVar[CloneRefusal]
    CLONE_REFUSAL_QUOTA: _ClassVar[CloneRefusal]
    CLONE_REFUSAL_WINDOW: _ClassVar[CloneRefusal]
CLONE_REFUSAL_UNSPECIFIED: CloneRefusal
CLONE_REFUSAL_POSITION: CloneRefusal
CLONE_REFUSAL_BOUNDARY: CloneRefusal
CLONE_REFUSAL_CONTENT_MISMATCH: CloneRefusal
CLONE_REFUSAL_PREPARED_INPUT: CloneRefusal
CLONE_REFUSAL_SOURCE_UNUSABLE: CloneRefusal
CLONE_REFUSAL_STOPPING: CloneRefusal
CLONE_REFUSAL_QUOTA: CloneRefusal
CLONE_REFUSAL_WINDOW: CloneRefusal

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TextInput(_message.Message):
    __slots__ = ("text", "chat", "system", "add_special_tokens", "messages")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: bool
    system: str
    add_special_tokens: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[bool] = ..., system: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class PreparedInput(_message.Message):
    __slots__ = ("kind", "payload", "shape")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    payload: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[str] = ..., payload: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerationConfig(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop_tokens", "ignore_eos", "prefill_chunk", "top_logprobs", "json_schema", "drawn_tokens", "speculative")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    DRAWN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_tokens: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    prefill_chunk: int
    top_logprobs: int
    json_schema: str
    drawn_tokens: int
    speculative: str
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_tokens: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., prefill_chunk: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., drawn_tokens: _Optional[int] = ..., speculative: _Optional[str] = ...) -> None: ...

class CaptureOptions(_message.Message):
    __slots__ = ("prompt_snapshot", "breakpoints", "snapshot_owner", "final_snapshot", "checkpoint_every")
    PROMPT_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BREAKPOINTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_OWNER_FIELD_NUMBER: _ClassVar[int]
    FINAL_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_FIELD_NUMBER: _ClassVar[int]
    prompt_snapshot: bool
    breakpoints: _containers.RepeatedScalarFieldContainer[int]
    snapshot_owner: str
    final_snapshot: bool
    checkpoint_every: int
    def __init__(self, prompt_snapshot: _Optional[bool] = ..., breakpoints: _Optional[_Iterable[int]] = ..., snapshot_owner: _Optional[str] = ..., final_snapshot: _Optional[bool] = ..., checkpoint_every: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session", "tokens", "text", "prepared", "config", "capture", "keep_session", "close_session")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    KEEP_SESSION_FIELD_NUMBER: _ClassVar[int]
    CLOSE_SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    tokens: TokenIds
    text: TextInput
    prepared: PreparedInput
    config: GenerationConfig
    capture: CaptureOptions
    keep_session: bool
    close_session: bool
    def __init__(self, session: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[_Union[TextInput, _Mapping]] = ..., prepared: _Optional[_Union[PreparedInput, _Mapping]] = ..., config: _Optional[_Union[GenerationConfig, _Mapping]] = ..., capture: _Optional[_Union[CaptureOptions, _Mapping]] = ..., keep_session: _Optional[bool] = ..., close_session: _Optional[bool] = ...) -> None: ...

class StartedEvent(_message.Message):
    __slots__ = ("session", "position", "input_positions")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    INPUT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    session: str
    position: int
    input_positions: int
    def __init__(self, session: _Optional[str] = ..., position: _Optional[int] = ..., input_positions: _Optional[int] = ...) -> None: ...

class TokensEvent(_message.Message):
    __slots__ = ("ids", "text", "logprobs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("chosen", "top")
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    chosen: LogprobEntry
    top: _containers.RepeatedCompositeFieldContainer[LogprobEntry]
    def __init__(self, chosen: _Optional[_Union[LogprobEntry, _Mapping]] = ..., top: _Optional[_Iterable[_Union[LogprobEntry, _Mapping]]] = ...) -> None: ...

class LogprobEntry(_message.Message):
    __slots__ = ("id", "logprob", "text", "raw")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    text: str
    raw: bytes
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ..., text: _Optional[str] = ..., raw: _Optional[bytes] = ...) -> None: ...

class SnapshotEvent(_message.Message):
    __slots__ = ("handle", "position", "kind", "refusal", "content_digest", "reason")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    handle: str
    position: int
    kind: str
    refusal: str
    content_digest: bytes
    reason: CloneRefusal
    def __init__(self, handle: _Optional[str] = ..., position: _Optional[int] = ..., kind: _Optional[str] = ..., refusal: _Optional[str] = ..., content_digest: _Optional[bytes] = ..., reason: _Optional[_Union[CloneRefusal, str]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("time_to_first_token_s", "decode_tokens_per_s", "total_s")
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_s: float
    decode_tokens_per_s: float
    total_s: float
    def __init__(self, time_to_first_token_s: _Optional[float] = ..., decode_tokens_per_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class DoneEvent(_message.Message):
    __slots__ = ("finish_reason", "prompt_positions", "reused_positions", "generated_tokens", "timings", "position", "engine", "resumes", "resumed_positions", "resume_pause_s")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    REUSED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    RESUMED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    RESUME_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_positions: int
    reused_positions: int
    generated_tokens: int
    timings: Timings
    position: int
    engine: str
    resumes: int
    resumed_positions: int
    resume_pause_s: float
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_positions: _Optional[int] = ..., reused_positions: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., position: _Optional[int] = ..., engine: _Optional[str] = ..., resumes: _Optional[int] = ..., resumed_positions: _Optional[int] = ..., resume_pause_s: _Optional[float] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("started", "tokens", "snapshot", "done")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    started: StartedEvent
    tokens: TokensEvent
    snapshot: SnapshotEvent
    done: DoneEvent
    def __init__(self, started: _Optional[_Union[StartedEvent, _Mapping]] = ..., tokens: _Optional[_Union[TokensEvent, _Mapping]] = ..., snapshot: _Optional[_Union[SnapshotEvent, _Mapping]] = ..., done: _Optional[_Union[DoneEvent, _Mapping]] = ...) -> None: ...

class CloneRequest(_message.Message):
    __slots__ = ("session", "upto", "new_owner", "expected_content_digest")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    UPTO_FIELD_NUMBER: _ClassVar[int]
    NEW_OWNER_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CONTENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    session: str
    upto: int
    new_owner: str
    expected_content_digest: bytes
    def __init__(self, session: _Optional[str] = ..., upto: _Optional[int] = ..., new_owner: _Optional[str] = ..., expected_content_digest: _Optional[bytes] = ...) -> None: ...

class CloneResponse(_message.Message):
    __slots__ = ("session", "position", "refusal", "reason", "content_digest")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    session: str
    position: int
    refusal: str
    reason: CloneRefusal
    content_digest: bytes
    def __init__(self, session: _Optional[str] = ..., position: _Optional[int] = ..., refusal: _Optional[str] = ..., reason: _Optional[_Union[CloneRefusal, str]] = ..., content_digest: _Optional[bytes] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseOwnerRequest(_message.Message):
    __slots__ = ("keep", "paid_only")
    KEEP_FIELD_NUMBER: _ClassVar[int]
    PAID_ONLY_FIELD_NUMBER: _ClassVar[int]
    keep: _containers.RepeatedScalarFieldContainer[str]
    paid_only: bool
    def __init__(self, keep: _Optional[_Iterable[str]] = ..., paid_only: _Optional[bool] = ...) -> None: ...

class ReleaseOwnerResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ExportSessionRequest(_message.Message):
    __slots__ = ("session", "extra", "upto")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    UPTO_FIELD_NUMBER: _ClassVar[int]
    session: str
    extra: _containers.ScalarMap[str, str]
    upto: int
    def __init__(self, session: _Optional[str] = ..., extra: _Optional[_Mapping[str, str]] = ..., upto: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("data", "file_bytes", "positions", "content_digest", "refusal")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    file_bytes: int
    positions: int
    content_digest: bytes
    refusal: str
    def __init__(self, data: _Optional[bytes] = ..., file_bytes: _Optional[int] = ..., positions: _Optional[int] = ..., content_digest: _Optional[bytes] = ..., refusal: _Optional[str] = ...) -> None: ...

class ImportSessionResponse(_message.Message):
    __slots__ = ("session", "refusal", "detail", "positions", "content_digest", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    session: str
    refusal: str
    detail: str
    positions: int
    content_digest: bytes
    extra: _containers.ScalarMap[str, str]
    def __init__(self, session: _Optional[str] = ..., refusal: _Optional[str] = ..., detail: _Optional[str] = ..., positions: _Optional[int] = ..., content_digest: _Optional[bytes] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("position", "generating", "content_digest")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    CONTENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    position: int
    generating: bool
    content_digest: bytes
    def __init__(self, position: _Optional[int] = ..., generating: _Optional[bool] = ..., content_digest: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_sessions", "max_session_tokens", "vocab_size", "idle_session_timeout_s", "owner_max_sessions", "owner_max_positions", "persistent_owner_max_sessions", "persistent_owner_max_positions", "max_positions", "kv_bytes_per_position", "clone_shared_bytes_per_position", "clone_shared_ring_positions")
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    IDLE_SESSION_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    OWNER_MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OWNER_MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_OWNER_MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_OWNER_MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    CLONE_SHARED_BYTES_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    CLONE_SHARED_RING_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    max_sessions: int
    max_session_tokens: int
    vocab_size: int
    idle_session_timeout_s: float
    owner_max_sessions: int
    owner_max_positions: int
    persistent_owner_max_sessions: int
    persistent_owner_max_positions: int
    max_positions: int
    kv_bytes_per_position: int
    clone_shared_bytes_per_position: int
    clone_shared_ring_positions: int
    def __init__(self, max_sessions: _Optional[int] = ..., max_session_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., idle_session_timeout_s: _Optional[float] = ..., owner_max_sessions: _Optional[int] = ..., owner_max_positions: _Optional[int] = ..., persistent_owner_max_sessions: _Optional[int] = ..., persistent_owner_max_positions: _Optional[int] = ..., max_positions: _Optional[int] = ..., kv_bytes_per_position: _Optional[int] = ..., clone_shared_bytes_per_position: _Optional[int] = ..., clone_shared_ring_positions: _Optional[int] = ...) -> None: ...

class OwnerUsage(_message.Message):
    __slots__ = ("owner", "persistent", "sessions", "positions", "max_sessions", "max_positions")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    persistent: bool
    sessions: int
    positions: int
    max_sessions: int
    max_positions: int
    def __init__(self, owner: _Optional[str] = ..., persistent: _Optional[bool] = ..., sessions: _Optional[int] = ..., positions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_positions: _Optional[int] = ...) -> None: ...

class WindowGeometry(_message.Message):
    __slots__ = ("sliding_window", "max_write", "evicts")
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_WRITE_FIELD_NUMBER: _ClassVar[int]
    EVICTS_FIELD_NUMBER: _ClassVar[int]
    sliding_window: int
    max_write: int
    evicts: bool
    def __init__(self, sliding_window: _Optional[int] = ..., max_write: _Optional[int] = ..., evicts: _Optional[bool] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "fingerprint", "limits", "cache_kind", "instance_id", "resident_sessions", "open_handles", "eos_token_ids", "caller", "active_generations", "queued_commands", "compute_path", "slow_path", "window", "chat_template", "architecture", "draining", "heartbeat_age_s", "heartbeat_longest_s", "pinned_exports", "role", "speculative", "num_drafts", "draft_tokens", "accepted_draft_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_KIND_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_HANDLES_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_COMMANDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOW_PATH_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_LONGEST_S_FIELD_NUMBER: _ClassVar[int]
    PINNED_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    fingerprint: str
    limits: Limits
    cache_kind: str
    instance_id: str
    resident_sessions: int
    open_handles: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    caller: OwnerUsage
    active_generations: int
    queued_commands: int
    compute_path: str
    slow_path: bool
    window: WindowGeometry
    chat_template: bool
    architecture: str
    draining: bool
    heartbeat_age_s: float
    heartbeat_longest_s: float
    pinned_exports: bool
    role: str
    speculative: str
    num_drafts: int
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., cache_kind: _Optional[str] = ..., instance_id: _Optional[str] = ..., resident_sessions: _Optional[int] = ..., open_handles: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., caller: _Optional[_Union[OwnerUsage, _Mapping]] = ..., active_generations: _Optional[int] = ..., queued_commands: _Optional[int] = ..., compute_path: _Optional[str] = ..., slow_path: _Optional[bool] = ..., window: _Optional[_Union[WindowGeometry, _Mapping]] = ..., chat_template: _Optional[bool] = ..., architecture: _Optional[str] = ..., draining: _Optional[bool] = ..., heartbeat_age_s: _Optional[float] = ..., heartbeat_longest_s: _Optional[float] = ..., pinned_exports: _Optional[bool] = ..., role: _Optional[str] = ..., speculative: _Optional[str] = ..., num_drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "message_ends", "cache_scope")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ENDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    text: TextInput
    message_ends: int
    cache_scope: str
    def __init__(self, text: _Optional[_Union[TextInput, _Mapping]] = ..., message_ends: _Optional[int] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids", "message_ends")
    IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ENDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    message_ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., message_ends: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
