"""SessionSettings: the sessions layer's options (handle expiry, persistent owners, quotas, snapshot
key), whose defaults are ``forkline-engine``'s, and the flags that set them."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from engine_service.api.checks import checked_float
from engine_service.api.engine_info import ENGINE_ROLES
from engine_service.api.errors import InvalidArgument
from engine_service.api.owners import NO_QUOTA, PERSISTENT_OWNER, OwnerQuota, PersistentOwners
from engine_service.executors.options import ExecutorSettings
from engine_service.persistence.snapshot_key import SnapshotKey, read_snapshot_key
from engine_service.sessions.handles import DEFAULT_PERSISTENT_SHARE, engine_quotas

DEFAULT_IDLE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SessionSettings:
    """``quota`` / ``persistent_quota`` None: :func:`engine_quotas`' defaults for the executor's limits.
    ``eos_token_ids`` None: the tokenizer's. ``prepared_inputs``: also accept ``embeddings`` inputs."""

    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # 0: client handles never expire
    persistent_owners: frozenset[str] = PersistentOwners((PERSISTENT_OWNER,))
    quota: OwnerQuota | None = None
    persistent_quota: OwnerQuota | None = None
    prepared_inputs: bool = False
    eos_token_ids: tuple[int, ...] | None = None
    snapshot_key: SnapshotKey | None = field(default=None, compare=False, repr=False)
    role: str = "both"  # --role (api.engine_info.ENGINE_ROLES)

    def __post_init__(self) -> None:
        if self.role not in ENGINE_ROLES:
            raise InvalidArgument(f"role must be one of {', '.join(ENGINE_ROLES)}, got {self.role!r}")
        checked_float("idle_timeout_s", self.idle_timeout_s, lo=0)
        if not isinstance(self.persistent_owners, frozenset):  # PersistentOwners (prefixes) stays as given
            object.__setattr__(self, "persistent_owners", frozenset(self.persistent_owners))

    def quotas(self, executor: ExecutorSettings) -> tuple[OwnerQuota, OwnerQuota]:
        """(each client's quota, each persistent owner's) on an engine built with ``executor``."""
        client, persistent = engine_quotas(executor.max_sessions, executor.max_session_tokens)
        return (
            client if self.quota is None else self.quota,
            persistent if self.persistent_quota is None else self.persistent_quota,
        )


# no expiry and no quotas: an engine embedded in one program (tests, benches), not a shared service
UNLIMITED = SessionSettings(idle_timeout_s=0.0, quota=NO_QUOTA, persistent_quota=NO_QUOTA)


def add_session_options(parser: argparse.ArgumentParser) -> None:
    """Handle expiry, persistent owners, quotas, the snapshot key, ``--prepared_inputs`` and ``--role``."""
    parser.add_argument(
        "--role",
        choices=ENGINE_ROLES,
        default="both",
        help="what the prefix service routes here: both (whole generations); prefill or decode, a split "
        "fleet's halves: prompts are prefilled on prefill engines and their sessions handed to decode "
        "engines, which stream the answers (docs/RESUME.md#prefill-decode-hand-off) (default: %(default)s)",
    )
    parser.add_argument(
        "--idle_session_timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="seconds after which an idle client session handle expires; 0: never (default: %(default)s)",
    )
    parser.add_argument(
        "--persistent_owner",
        action="append",
        default=None,
        metavar="OWNER",
        help="an owner whose handles never expire and who has the persistent budget instead of the "
        f"client quota; repeatable (default: {PERSISTENT_OWNER}, unless --persistent_owner_prefix is given)",
    )
    parser.add_argument(
        "--persistent_owner_prefix",
        action="append",
        default=None,
        metavar="PREFIX",
        help="every owner whose id starts with PREFIX is a persistent owner (prefix replicas "
        "forkline-prefix-0, -1, ... join without a change here; with --auth_tokens only tokens the "
        "operator maps to such an owner can be one); repeatable (default: none)",
    )
    parser.add_argument(
        "--owner_max_sessions",
        metavar="N",
        type=int,
        default=None,
        help="resident sessions one client owner may hold, live or kept (clones and snapshots "
        "included); 0: no limit (default: a quarter of --max_sessions, at least 1)",
    )
    parser.add_argument(
        "--owner_max_positions",
        metavar="N",
        type=int,
        default=None,
        help="positions one client owner's sessions may hold together (a generation reserves "
        "position + input + min(max_new_tokens, G) and grows by G as it runs, ending with finish "
        "reason 'length' when no more fits; G = 256, or max_session_tokens / 8 when smaller); "
        "0: no limit "
        "(default: owner_max_sessions * max_session_tokens / 2)",
    )
    parser.add_argument(
        "--persistent_owner_share",
        metavar="F",
        type=float,
        default=DEFAULT_PERSISTENT_SHARE,
        help="share of the engine's sessions and positions each persistent owner (the prefix "
        "service) may hold, in [0, 1]; 0: no limit (default: %(default)s)",
    )
    parser.add_argument(
        "--snapshot_key",
        metavar="FILE",
        default=None,
        help="a secret (at least 32 bytes; mode 600 or 640) that signs exported snapshot files with "
        "a keyed MAC; imports must carry a valid MAC (default: none, files are checksummed only)",
    )
    parser.add_argument(
        "--prepared_inputs",
        action="store_true",
        help="also accept prepared 'embeddings' inputs (EmbeddingsExecutor); off by default",
    )


def session_settings(args: argparse.Namespace, executor: ExecutorSettings) -> SessionSettings:
    """The flags' settings; bad quota flags or key fail here, before any model loads."""
    quota, persistent_quota = engine_quotas(
        executor.max_sessions,
        executor.max_session_tokens,
        owner_max_sessions=args.owner_max_sessions,
        owner_max_positions=args.owner_max_positions,
        persistent_owner_share=args.persistent_owner_share,
    )
    snapshot_key = read_snapshot_key(args.snapshot_key) if args.snapshot_key else None
    if snapshot_key is not None:
        logging.getLogger("forkline-engine").info(
            "snapshot files signed with the key in %s", args.snapshot_key
        )
    return SessionSettings(
        idle_timeout_s=args.idle_session_timeout,
        persistent_owners=PersistentOwners(
            args.persistent_owner or (() if args.persistent_owner_prefix else (PERSISTENT_OWNER,)),
            args.persistent_owner_prefix or (),
        ),
        quota=quota,
        persistent_quota=persistent_quota,
        prepared_inputs=args.prepared_inputs,
        snapshot_key=snapshot_key,
        role=args.role,
    )
