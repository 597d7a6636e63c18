"""EngineInfo: what an engine says about itself (its ``Info`` answer): identity, limits, quotas, the
caller's use, load, window geometry and compute path. A limit of 0 means "not reported"."""

from __future__ import annotations

from dataclasses import dataclass

from engine_service.api.owners import NO_QUOTA, OwnerQuota, OwnerUsage


@dataclass(frozen=True)
class WindowGeometry:
    """What a clone of a sliding-window model can reach."""

    sliding_window: int = 0  # the largest window of the sliding layers (0: none slide)
    max_write: int = 0  # positions one forward writes per session at most
    # rows older than the window are dropped (ring layers): a clone below written - max_write is refused
    evicts: bool = False


NO_WINDOW = WindowGeometry()


ENGINE_ROLES = ("both", "prefill", "decode")  # forkline-engine --role


@dataclass(frozen=True)
class EngineInfo:
    """``instance_id`` changes when the engine restarts; ``caller`` None: the answer did not say."""

    instance_id: str
    fingerprint: str
    vocab_size: int
    max_session_tokens: int
    max_sessions: int = 0
    # the positions the engine's K/V holds in all (its --kv_memory_mib over kv_bytes_per_position, at
    # most max_sessions x max_session_tokens), and the bytes one position of one session costs
    max_positions: int = 0
    kv_bytes_per_position: int = 0
    # of those, the bytes a clone shares with its source instead of copying (0: a whole copy, or unsaid)
    clone_shared_bytes_per_position: int = 0
    clone_shared_ring_positions: int = 0  # below it a clone shares every layer (EngineLimits)
    model: str = ""
    cache_kind: str = ""
    architecture: str = ""
    eos_token_ids: tuple[int, ...] = ()
    chat_template: bool = True  # False: a base model without one (send plain text)
    idle_session_timeout_s: float = 0.0
    client_quota: OwnerQuota = NO_QUOTA  # what each client owner may hold
    persistent_quota: OwnerQuota = NO_QUOTA  # what each persistent owner may hold
    caller: OwnerUsage | None = None  # the asking owner: what it holds and may hold
    resident_sessions: int = 0
    open_handles: int = 0
    active_generations: int = 0  # the load, all callers: generations running, commands queued
    queued_commands: int = 0
    window: WindowGeometry = NO_WINDOW
    compute_path: str = ""  # e.g. "kernels q4_1 avx2 x2 threads, ..."
    slow_path: bool = False  # far below the machine's best (the engine logged how to fix it)
    draining: bool = False  # SIGTERM: no new work, finishing what runs, then gone
    heartbeat_age_s: float = 0.0  # since the engine thread last answered (runtime/heartbeat.py)
    heartbeat_longest_s: float = 0.0  # the longest it took to answer so far
    # a stored snapshot (a clone or import not generated since) exports without waiting for the
    # engine thread's running forward (``Session.export_async``)
    pinned_exports: bool = False
    # --role: "both" serves whole generations; "prefill" / "decode" a split fleet's halves (the prefix
    # service prefills on one and hands the session to the other: fleet/handoff.py)
    role: str = "both"
    # --speculative ("off", "lookup") and --num_drafts (0: off); draft tokens verified and accepted
    speculative: str = "off"
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def caller_quota(self) -> OwnerQuota:
        return self.caller.quota if self.caller is not None else NO_QUOTA

    @property
    def max_rewind(self) -> int | None:
        """How far below a snapshot's length a clone can reach (None: any committed position)."""
        return self.window.max_write if self.window.evicts else None
