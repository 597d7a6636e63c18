"""PrefixServicer: ``forkline.prefix.v1.PrefixCache`` over a :class:`Fleet` of engine gateways.

Thin: each RPC reads the caller's owner id from the metadata, converts the request to domain values
(``prefix_service/rpc/convert.py``), delegates to the fleet (``prefix_service/fleet/fleet.py``: routing to an
engine) and its gateways (``prefix_service/gateway/gateway.py``, where every flow decision lives:
engine-restart handling, lookup, insert, the gateway Generate with its stop and drain) and converts the answer back. Errors map to status codes in
``engine_service/serving/errors.py``. Engine calls made for an RPC carry its deadline (``caller_deadline``).
The namespace a request names (and its ``cache_salt``) is the caller's scope (``gateway/tenancy.py``);
Stats and Clear cover the caller's own scopes unless it is the admin; so does CacheEvents, a stream of
the caches' :class:`~prefix_service.cache.events.EventHub` (one per servicer: every member's cache is
attached to it, ``follow``; closed at shutdown, which ends the streams).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from engine_service.serving.auth import owner_of
from engine_service.serving.errors import status_on_error
from engine_service.serving.tokens import current_caller
from prefix_service.cache.events import EventHub
from prefix_service.engines.engine_watch import caller_deadline
from prefix_service.fleet.fleet import Fleet
from prefix_service.fleet.member import EngineMember
from prefix_service.gateway.tenancy import Tenancy, Tenant
from prefix_service.rpc import convert
from protos import engine_pb2 as epb
from protos import prefix_pb2 as pb
from protos import prefix_pb2_grpc


class PrefixServicer(prefix_pb2_grpc.PrefixCacheServicer):
    def __init__(self, fleet: Fleet, tenancy: Tenancy | None = None) -> None:
        self.gateway = fleet
        self.tenancy = tenancy or Tenancy()
        self.events = EventHub()
        for member in fleet.members():
            self.follow(member)

    def follow(self, member: EngineMember) -> None:
        """Publish ``member``'s cache events (again: rebinds; an engine that joins later is followed
        when it joins)."""
        backend = member.gateway.backend
        self.events.attach(member.gateway.cache, member.name, lambda: backend.instance_id)

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        with status_on_error(context), caller_deadline(context):
            tenant = tenant_of(context)
            scope = self.tenancy.scope(tenant, request.namespace, request.cache_salt)
            lookup = self.gateway.lookup(scope, convert.prompt(request), tenant.owner, context.is_active)
            return convert.lookup_response(lookup)

    def Insert(self, request: pb.InsertRequest, context: grpc.ServicerContext) -> pb.InsertResponse:
        with status_on_error(context), caller_deadline(context):
            tenant = tenant_of(context)
            owner = tenant.owner
            outcome = self.gateway.insert(
                self.tenancy.scope(tenant, request.namespace, request.cache_salt),
                list(request.tokens),
                request.session,
                dict(request.metadata),
                owner,
                request.engine,
            )
            return convert.insert_response(outcome)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with status_on_error(context):
            return convert.stats_response(self.gateway.stats(self.tenancy.visible(tenant_of(context))))

    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearResponse:
        with status_on_error(context), caller_deadline(context):
            return pb.ClearResponse(released=self.gateway.clear(self.tenancy.visible(tenant_of(context))))

    def Generate(
        self, request: pb.GatewayGenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[epb.GenerateEvent]:
        with status_on_error(context):
            tenant = tenant_of(context)
            scope = self.tenancy.scope(tenant, request.namespace, request.cache_salt)
            with caller_deadline(context):  # the engine stream gets the caller's deadline
                stream = self.gateway.generate(convert.gateway_request(request, scope), tenant.owner)
            context.add_callback(stream.stop)  # the client went away
            with contextlib.closing(iter(stream)) as events:
                for event in events:
                    yield convert.client_event(event)

    def CacheEvents(
        self, request: pb.CacheEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.CacheEvent]:
        with status_on_error(context):
            where = self.tenancy.visible(tenant_of(context))
            self.events.retain(m.gateway.cache for m in self.gateway.members())  # engines that left: gone
            subscription = self.events.subscribe(where, replay=request.replay)
        context.add_callback(subscription.close)  # the client went away: unsubscribe, end the loop
        with subscription:
            for event in subscription:
                yield convert.cache_event(event)


def tenant_of(context: grpc.ServicerContext) -> Tenant:
    """The caller: its owner, authenticated when the call carried a valid token."""
    return Tenant(owner_of(context.invocation_metadata()), current_caller() is not None)
