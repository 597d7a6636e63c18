"""``EngineInfo`` <-> ``InfoResponse``."""

from __future__ import annotations

from engine_service.api.engine_info import EngineInfo, WindowGeometry
from engine_service.api.owners import OwnerQuota, OwnerUsage
from protos import engine_pb2 as pb


def info_message(info: EngineInfo) -> pb.InfoResponse:
    """``EngineInfo`` as the engine's ``InfoResponse``."""
    caller, window = info.caller, info.window
    return pb.InfoResponse(
        model=info.model,
        fingerprint=info.fingerprint,
        limits=pb.Limits(
            max_sessions=info.max_sessions,
            max_session_tokens=info.max_session_tokens,
            vocab_size=info.vocab_size,
            idle_session_timeout_s=info.idle_session_timeout_s,
            owner_max_sessions=info.client_quota.max_sessions,
            owner_max_positions=info.client_quota.max_positions,
            persistent_owner_max_sessions=info.persistent_quota.max_sessions,
            persistent_owner_max_positions=info.persistent_quota.max_positions,
            max_positions=info.max_positions,
            kv_bytes_per_position=info.kv_bytes_per_position,
            clone_shared_bytes_per_position=info.clone_shared_bytes_per_position,
            clone_shared_ring_positions=info.clone_shared_ring_positions,
        ),
        cache_kind=info.cache_kind,
        instance_id=info.instance_id,
        resident_sessions=info.resident_sessions,
        open_handles=info.open_handles,
        eos_token_ids=list(info.eos_token_ids),
        caller=None
        if caller is None
        else pb.OwnerUsage(
            owner=caller.owner,
            persistent=caller.persistent,
            sessions=caller.sessions,
            positions=caller.positions,
            max_sessions=caller.quota.max_sessions,
            max_positions=caller.quota.max_positions,
        ),
        active_generations=info.active_generations,
        queued_commands=info.queued_commands,
        compute_path=info.compute_path,
        slow_path=info.slow_path,
        window=pb.WindowGeometry(
            sliding_window=window.sliding_window, max_write=window.max_write, evicts=window.evicts
        ),
        chat_template=info.chat_template,
        architecture=info.architecture,
        draining=info.draining,
        heartbeat_age_s=info.heartbeat_age_s,
        heartbeat_longest_s=info.heartbeat_longest_s,
        pinned_exports=info.pinned_exports,
        role=info.role,
        speculative=info.speculative,
        num_drafts=info.num_drafts,
        draft_tokens=info.draft_tokens,
        accepted_draft_tokens=info.accepted_draft_tokens,
    )


def engine_info(msg: pb.InfoResponse) -> EngineInfo:
    """An ``InfoResponse`` as ``EngineInfo`` (``caller`` None when it names no owner)."""
    limits, caller, window = msg.limits, msg.caller, msg.window
    return EngineInfo(
        instance_id=msg.instance_id,
        fingerprint=msg.fingerprint,
        vocab_size=limits.vocab_size,
        max_session_tokens=limits.max_session_tokens,
        max_sessions=limits.max_sessions,
        max_positions=limits.max_positions,
        kv_bytes_per_position=limits.kv_bytes_per_position,
        clone_shared_bytes_per_position=limits.clone_shared_bytes_per_position,
        clone_shared_ring_positions=limits.clone_shared_ring_positions,
        model=msg.model,
        cache_kind=msg.cache_kind,
        architecture=msg.architecture,
        eos_token_ids=tuple(msg.eos_token_ids),
        chat_template=msg.chat_template,
        idle_session_timeout_s=limits.idle_session_timeout_s,
        client_quota=OwnerQuota(limits.owner_max_sessions, limits.owner_max_positions),
        persistent_quota=OwnerQuota(
            limits.persistent_owner_max_sessions, limits.persistent_owner_max_positions
        ),
        caller=OwnerUsage(
            caller.owner,
            caller.persistent,
            caller.sessions,
            caller.positions,
            OwnerQuota(caller.max_sessions, caller.max_positions),
        )
        if caller.owner
        else None,
        resident_sessions=msg.resident_sessions,
        open_handles=msg.open_handles,
        active_generations=msg.active_generations,
        queued_commands=msg.queued_commands,
        window=WindowGeometry(window.sliding_window, window.max_write, window.evicts),
        compute_path=msg.compute_path,
        slow_path=msg.slow_path,
        draining=msg.draining,
        heartbeat_age_s=msg.heartbeat_age_s,
        heartbeat_longest_s=msg.heartbeat_longest_s,
        pinned_exports=msg.pinned_exports,
        role=msg.role or "both",
        speculative=msg.speculative or "off",
        num_drafts=msg.num_drafts,
        draft_tokens=msg.draft_tokens,
        accepted_draft_tokens=msg.accepted_draft_tokens,
    )
