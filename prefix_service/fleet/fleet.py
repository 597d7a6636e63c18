"""Fleet: one prefix service in front of many engines (an :class:`EngineMember` each), routing every
request to where its prefix is: routable engines (SERVING, the fleet's fingerprint) scored by the
positions they reuse, their load and fill, ordered by the routing policy. Spec: docs/ROUTING.md."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from engine_service.api.call_context import CallContext
from engine_service.api.errors import ForklineError, InvalidArgument, NotFound, Unavailable
from engine_service.api.limits import check_nonempty
from engine_service.api.prompts import TextPrompt, Tokenized
from prefix_service.cache.index import token_key
from prefix_service.cache.outcomes import InsertOutcome
from prefix_service.fleet.attempts import first_that_serves, started_on, tokenized_by_first
from prefix_service.fleet.handoff import DECODE_ROLES, PREFILL_ROLES, first_token, is_split, role_of
from prefix_service.fleet.member import EngineMember, RoutedStream
from prefix_service.fleet.moves import SnapshotMover
from prefix_service.fleet.rates import RateMeter
from prefix_service.fleet.resume import MAX_RESUMES, ResumingStream
from prefix_service.fleet.route import SNAPSHOT_DIR
from prefix_service.fleet.routing import (
    DEFAULT_ROUTING,
    Candidate,
    Move,
    Route,
    RouteReason,
    RouteRequest,
    RoutingPolicy,
    routing_policy,
)
from prefix_service.fleet.stats import FleetStats, engine_status, summed
from prefix_service.gateway.calls import GatewayRequest, Prompt, PromptLookup
from prefix_service.gateway.gateway import Gateway
from prefix_service.tier.persistent_tier import PersistentTier

log = logging.getLogger(__name__)


class Fleet:
    """``policy``: the routing policy (default ``routing.DEFAULT_ROUTING``); ``rates``: the measured
    rates it reads. A request is routed once: moves to its first engine happen before it serves; an
    engine that fails before the first event passes it on; with one engine errors propagate unchanged."""

    def __init__(
        self,
        members: Iterable[EngineMember] = (),
        policy: RoutingPolicy | None = None,
        rates: RateMeter | None = None,
    ) -> None:
        self.policy = policy or routing_policy(DEFAULT_ROUTING)
        self.rates = rates or RateMeter()
        self.mover = SnapshotMover(self.rates)
        self._lock = threading.Lock()
        self._members: dict[str, EngineMember] = {}
        self.fingerprint = ""
        self._routes: Counter[str] = Counter()
        self.tier: PersistentTier | None = None  # the snapshot directory every engine's gateway shares
        self.max_resumes = MAX_RESUMES  # --max_resumes
        for member in members:
            self.add(member)

    # -- membership ----------------------------------------------------------------------------
    def add(self, member: EngineMember) -> None:
        """Start routing to ``member`` (a name already present: InvalidArgument)."""
        with self._lock:
            if member.name in self._members:
                raise InvalidArgument(f"engine {member.name!r} is already in the fleet")
            self._members[member.name] = member
            self._elect()
            if member.fingerprint != self.fingerprint:
                log.warning(
                    "engine %s has fingerprint %s, not the fleet's %s: held out of routing",
                    member.name,
                    member.fingerprint[:16],
                    self.fingerprint[:16],
                )
        log.info("engine %s joined (instance %s)", member.name, member.gateway.instance_id)

    def remove(self, name: str) -> int:
        """Stop routing to engine ``name``, release its entries and close it; the entries dropped."""
        with self._lock:
            member = self._members.pop(name, None)
            self._elect()
        if member is None:
            return 0
        try:
            dropped = member.gateway.clear()
        except Exception:  # noqa: BLE001 - the engine is gone: its handles went with it
            dropped = len(member.gateway)
            log.debug("could not release the entries of engine %s", name, exc_info=True)
        finally:
            member.close()
        log.info("engine %s left: dropped %d entries", name, dropped)
        return dropped

    def members(self) -> list[EngineMember]:
        with self._lock:
            return list(self._members.values())

    @property
    def chat_template(self) -> bool:
        """Whether the fleet's engines render conversations (their Info's ``chat_template``; False: a
        base model). True until an engine of the fleet's fingerprint has answered Info."""
        infos = [m.gateway.last_info for m in self.members() if m.fingerprint == self.fingerprint]
        return all(i is None for i in infos) or any(i is not None and i.chat_template for i in infos)

    def member(self, name: str) -> EngineMember:
        with self._lock:
            member = self._members.get(name)
        if member is None:
            raise NotFound(f"engine {name!r} is not one of this service's engines")
        return member

    def sole(self) -> Gateway:
        """The gateway of the only engine (InvalidArgument with several: name one)."""
        members = self.members()
        if len(members) != 1:
            raise InvalidArgument(f"the service routes to {len(members)} engines, not one")
        return members[0].gateway

    def refresh(self) -> None:
        """Read every engine's Info (restarts, load) and re-elect the fingerprint; errors are logged."""
        for member in self.members():
            try:
                member.gateway.check_engine()
                member.observe()
            except ForklineError as exc:
                log.debug("engine %s: %s", member.name, exc)
        with self._lock:
            self._elect()

    def check_engine(self) -> None:
        """Refresh every engine; Unavailable when none is routable (one engine: its own error)."""
        members = self.members()
        if len(members) == 1:
            members[0].gateway.check_engine()
            members[0].observe()
            return
        self.refresh()
        self._routable()

    # -- calls -----------------------------------------------------------------------------------
    def lookup(
        self,
        namespace: str,
        prompt: Prompt,
        call: CallContext,
        caller_active: Callable[[], bool] = lambda: True,
    ) -> PromptLookup:
        """Route ``prompt`` and clone the chosen engine's best snapshot for ``call``; the answer names it."""
        tokenized, route, _ = self._route(namespace, prompt, call)
        tokens = list(tokenized.ids)

        def lookup_on(member: EngineMember) -> PromptLookup:
            found = member.gateway.lookup(namespace, tokens, call, caller_active)
            return replace(found, engine=member.name)

        return first_that_serves(route, lookup_on)

    def insert(
        self,
        namespace: str,
        tokens: Sequence[int],
        session: str,
        metadata: Mapping[str, str],
        call: CallContext,
        engine: str = "",
    ) -> InsertOutcome:
        """Store a clone of ``call``'s ``session``, held by ``engine`` ("" with a single engine)."""
        if engine:
            member = self.member(engine)
        else:
            members = self.members()
            if len(members) != 1:
                raise InvalidArgument(
                    f"engine is required: the service routes to {len(members)} engines "
                    "(LookupResponse.engine names the engine of a session)"
                )
            member = members[0]
        return member.gateway.insert(namespace, tokens, session, metadata, call)

    def generate(self, request: GatewayRequest, call: CallContext) -> ResumingStream:
        """Route and start the generation; returns once an engine started it (one failing before that
        with UNAVAILABLE or RESOURCE_EXHAUSTED passes the request to the next in the route). An engine
        that fails mid-stream passes it on too, up to ``max_resumes`` times (``resume.py``);
        ``Done.engine`` names the engine that ended it."""
        wanted_ends = max((m.gateway.message_ends_wanted for m in self.members()), default=0)
        by_load = sorted(self._routable(), key=lambda m: (m.load, m.name))
        tokenized = tokenized_by_first(request.prompt, call, by_load, wanted_ends)
        check_nonempty(len(tokenized.ids))
        ends = tokenized.message_ends if isinstance(request.prompt, TextPrompt) else request.message_ends
        routed = replace(request, prompt=list(tokenized.ids), message_ends=ends)  # message ends: checkpoints
        infos = [m.gateway.last_info for m in by_load if m.gateway.last_info is not None]
        eos = () if request.ignore_eos or not infos else infos[0].eos_token_ids
        stops = request.config.stop_tokens or eos
        if not is_split(self._routable()):
            start = lambda r, avoid: self._serve(r, call, avoid)  # noqa: E731
            return ResumingStream(start, routed, stops, self.max_resumes)
        prefill = lambda r, avoid: self._serve(first_token(r), call, avoid, PREFILL_ROLES)  # noqa: E731
        decode = lambda r, avoid, source="": self._serve(r, call, avoid, DECODE_ROLES, source)  # noqa: E731
        return ResumingStream(prefill, routed, stops, self.max_resumes, hand_off=decode)

    def _serve(
        self, routed: GatewayRequest, call: CallContext, avoid: frozenset[str], roles=(), source=""
    ) -> RoutedStream:
        """Start ``routed`` (token ids) on the first engine of its route that serves: ``roles``' engines
        first, ``avoid`` last; ``source`` (a hand-off): the engine whose prompt snapshot moves there."""
        tokens = routed.prompt
        _, route, reusable = self._route(routed.namespace, tokens, call, roles=roles)
        route = [m for m in route if m.name not in avoid] + [m for m in route if m.name in avoid]
        holder = next((m for m in route if m.name == source), None)
        if holder is not None and route[0] is not holder:
            target = route[0]
            key = token_key(tokens)
            if self.mover.move(holder, target, routed.namespace, key, reusable.get(target.name, 0)).moved:
                reusable[target.name] = target.candidate(routed.namespace, key).reusable
        return first_that_serves(
            route, lambda m: started_on(self.rates, m, routed, call, reusable.get(m.name, 0))
        )

    def tokenize(self, prompt: Prompt, call: CallContext) -> Tokenized:
        """``prompt``'s tokens as the least loaded engine that answers tokenizes them (the routing's
        tokenization: an HTTP door's counts and breakpoints)."""
        members = sorted(self._routable(), key=lambda m: (m.load, m.name))
        return tokenized_by_first(prompt, call, members, 0)

    def detokenize(self, ids: Sequence[int], call: CallContext) -> str:
        """The text of ``ids`` (InvalidArgument naming ``tokens`` for one outside the vocabulary)."""
        members = sorted(self._routable(), key=lambda m: (m.load, m.name))
        return first_that_serves(members, lambda m: m.gateway.detokenize(ids, call), retry=(Unavailable,))

    def stats(self, where: Callable[[str], bool] | None = None) -> FleetStats:
        """Every engine's stats; with ``where`` (a caller's scopes) only those entries, summed."""
        members = self.members()
        if where is not None:
            return FleetStats(summed([m.gateway.stats(where) for m in members]), self.policy.name, (), {})
        engines = tuple(engine_status(m, self._is_routable(m)) for m in members)
        with self._lock:
            routes = dict(self._routes)
        tier = self.tier
        return FleetStats(
            summed([e.stats for e in engines]),
            self.policy.name,
            engines,
            routes,
            tier.store.stats() if tier is not None else None,
        )

    def clear(self, where: Callable[[str], bool] | None = None) -> int:
        """Release every stored snapshot on every engine (or those ``where`` accepts); how many."""
        return sum(m.gateway.clear(where) for m in self.members())

    # -- internals -------------------------------------------------------------------------------
    def _elect(self) -> None:
        elected = elected_fingerprint(list(self._members.values()), self.fingerprint)  # lock held
        if elected != self.fingerprint and self.fingerprint:
            log.warning("routing to engines of fingerprint %s (was %s)", elected[:16], self.fingerprint[:16])
        self.fingerprint = elected

    def _is_routable(self, member: EngineMember) -> bool:
        return member.serving and member.fingerprint == self.fingerprint

    def _routable(self) -> list[EngineMember]:
        members = self.members()
        routable = [m for m in members if self._is_routable(m)]
        if routable:
            return routable
        if len(members) == 1:  # one engine: its own calls say what is wrong (e.g. waiting out an outage)
            return members
        raise Unavailable(f"no engine serves ({len(members)} known)" if members else "no engine is known yet")

    def _route(
        self,
        namespace: str,
        prompt: Prompt,
        call: CallContext,
        wanted_ends: int = 0,
        roles: Sequence[str] = (),
    ) -> tuple[Tokenized, list[EngineMember], dict[str, int]]:
        """The prompt tokenized, the engines to try in order, and the positions each can reuse; with
        ``roles`` (a split fleet's half) the policy picks among those engines, the others follow."""
        routable = self._routable()
        members = [m for m in routable if role_of(m) in roles] or routable if roles else routable
        others = [m for m in routable if m not in members]
        by_load = sorted(members, key=lambda m: (m.load, m.name))
        tokenized = tokenized_by_first(prompt, call, by_load, wanted_ends)
        tokens = list(tokenized.ids)
        draining = self._draining()
        if len(members) == 1 and not draining:
            self._count(members[0], None)
            return tokenized, members + others, {}
        key = token_key(tokens)  # validated once for every engine's index
        candidates = [m.candidate(namespace, key) for m in members]
        sources = tuple(m.candidate(namespace, key) for m in draining) + self._directory(
            members, namespace, key
        )
        route = self.policy.route(candidates, RouteRequest(len(tokens), self.rates.rates(), sources))
        named = {m.name: m for m in members}
        self._count(named[route.first.name], route)
        order = [named[c.name] for c in route.order] + others
        reusable = {c.name: c.reusable for c in candidates}
        if route.move is not None and _moved(
            self, route.move, order[0], namespace, key, reusable[order[0].name], call
        ):
            reusable[order[0].name] = route.move.reusable
        return tokenized, order, reusable

    def _draining(self) -> list[EngineMember]:
        """Engines of the fleet's fingerprint that serve no new request but still answer: draining."""
        return [
            m
            for m in self.members()
            if m.draining and not self._is_routable(m) and m.fingerprint == self.fingerprint
        ]

    def _directory(
        self, members: Sequence[EngineMember], namespace: str, key: tuple[int, ...]
    ) -> tuple[Candidate, ...]:
        """The snapshot directory as a move source when it holds a prefix of the prompt."""
        reusable = 0 if self.tier is None else members[0].gateway.from_directory(namespace, key)
        return (Candidate(SNAPSHOT_DIR, reusable, 0),) if reusable else ()

    def _count(self, first: EngineMember, route: Route | None) -> None:
        with self._lock:
            first.routed += 1
            if route is None:
                return
            self._routes[str(route.reason)] += 1
            if route.reason in (RouteReason.LOAD_GUARD, RouteReason.MOVE):
                best = max(route.order, key=lambda c: (c.reusable, -c.load))
                guarded = self._members.get(best.name)
                if guarded is not None:
                    guarded.load_guarded += 1


def _moved(
    fleet: Fleet,
    move: Move,
    target: EngineMember,
    namespace: str,
    key: tuple[int, ...],
    here: int,
    call: CallContext,
) -> bool:
    """Make ``move`` to ``target``; whether ``target`` now holds the moved prefix."""
    if move.source == SNAPSHOT_DIR:
        return (
            fleet.tier is not None and fleet.mover.restore(target, namespace, key, move.reusable, call).moved
        )
    holder = next((m for m in fleet.members() if m.name == move.source), None)
    if holder is None:
        return False
    return fleet.mover.move(holder, target, namespace, key, here).moved


def elected_fingerprint(members: Sequence[EngineMember], current: str) -> str:
    """The fingerprint most serving engines have (all engines when none serves); ties keep ``current``."""
    voters = [m for m in members if m.serving] or list(members)
    votes = Counter(m.fingerprint for m in voters)
    if not votes or votes.get(current, 0) == max(votes.values()):
        return current
    return next(m.fingerprint for m in voters if votes[m.fingerprint] == max(votes.values()))
