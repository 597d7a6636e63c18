"""Whose text pieces a Tokenize reads (``serving.auth.piece_scope``): an owner's own without a scope; a
scope under the authenticated owner -- so an owner naming another's scope never shares its pieces."""

from __future__ import annotations

import json

from engine_service.api.call_context import CallContext
from engine_service.serving.auth import OWNER_METADATA_KEY, AuthenticatedContext, piece_scope


class _Context:
    def __init__(self, owner: str | None = None) -> None:
        self._metadata = [(OWNER_METADATA_KEY, owner)] if owner else []

    def invocation_metadata(self):
        return self._metadata


def test_without_a_scope_each_owner_has_its_own():
    assert piece_scope(_Context("a"), None) == "a" and piece_scope(_Context("b"), None) == "b"
    assert piece_scope(_Context(), None) == "anonymous"
    assert piece_scope(_Context("a"), "") == json.dumps(["", ""])  # the default namespace is a scope


def test_a_scope_is_shared_by_unauthenticated_callers_only_within_it():
    one, two = piece_scope(_Context("anonymous-1"), "ns"), piece_scope(_Context("anonymous-2"), "ns")
    assert one == two == json.dumps(["", "ns"])
    assert piece_scope(_Context("anonymous-1"), '["", "ns", "salt"]') != one  # a salt is its own scope


def test_authenticated_owners_never_share_a_scope():
    alice = AuthenticatedContext(_Context(), CallContext("alice", "t1"))
    mallory = AuthenticatedContext(_Context("alice"), CallContext("mallory", "t2"))  # claims alice
    assert piece_scope(alice, "ns") != piece_scope(mallory, "ns")
    assert piece_scope(mallory, "ns") == json.dumps(["mallory", "ns"])
    assert piece_scope(alice, "ns") != piece_scope(_Context(), "ns")  # nor with unauthenticated ones


def test_the_wire_tells_an_unset_scope_from_the_empty_one():
    """The default namespace is the scope "" (shared by unauthenticated callers), unlike no scope."""
    from engine_service.api.prompts import TextPrompt
    from engine_service.serving import engine_wire

    unset = engine_wire.tokenize_request(TextPrompt("hi"), 0, None)
    empty = engine_wire.tokenize_request(TextPrompt("hi"), 0, "")
    assert not unset.HasField("cache_scope") and empty.HasField("cache_scope")
