"""Prefill/decode hand-off over engines started with ``forkline-engine --role``: in a split fleet (some
engine prefills only or decodes only) a generation's prompt and its first token run on a prefill engine
(``both`` engines serve either half), then the session moves to a decode engine (the prompt snapshot,
exported and imported: ``SnapshotMover``, refused when recomputing there is cheaper) and the rest of the
answer streams there as a resume does (``drawn_tokens``: exactly the colocated run). A hand-off whose
decode engine cannot start continues on the prefill side. Spec: docs/RESUME.md#prefill-decode-hand-off."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from prefix_service.fleet.member import EngineMember
from prefix_service.gateway.calls import GatewayRequest

PREFILL_ROLES = ("prefill", "both")
DECODE_ROLES = ("decode", "both")


def role_of(member: EngineMember) -> str:
    """The engine's ``--role`` as its last Info said ("both" until it answered)."""
    info = member.gateway.last_info
    return info.role if info is not None else "both"


def is_split(members: Sequence[EngineMember]) -> bool:
    """Whether ``members`` split the work: an engine prefills or decodes only, and both halves are served."""
    roles = {role_of(m) for m in members}
    return (
        bool(roles & {"prefill", "decode"})
        and any(r in PREFILL_ROLES for r in roles)
        and any(r in DECODE_ROLES for r in roles)
    )


def first_token(request: GatewayRequest) -> GatewayRequest:
    """The prefill half: the prompt and its first token."""
    return replace(request, config=replace(request.config, max_new_tokens=1))
