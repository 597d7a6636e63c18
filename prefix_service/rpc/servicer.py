"""PrefixServicer: ``forkline.prefix.v1.PrefixCache`` over a :class:`Fleet` of engine gateways. Thin: each
RPC makes its call context (``serving.auth.call_context``: owner, credential, deadline), scopes the
namespace (``gateway/tenancy.py``), converts (``convert.py``), delegates to the fleet and converts back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import grpc

from engine_service.api.call_context import CallContext
from engine_service.serving.auth import call_context
from engine_service.serving.errors import status_on_error
from prefix_service.cache.events import EventHub
from prefix_service.engines.engine_watch import RpcCall
from prefix_service.fleet.fleet import Fleet
from prefix_service.fleet.member import EngineMember
from prefix_service.gateway.tenancy import Tenancy, Tenant
from prefix_service.rpc import convert
from protos import engine_pb2 as epb
from protos import prefix_pb2 as pb
from protos import prefix_pb2_grpc


class PrefixServicer(prefix_pb2_grpc.PrefixCacheServicer):
    """Stats and Clear cover the caller's own scopes unless it is the admin; so does CacheEvents, a
    stream of the caches' :class:`EventHub` (every member's cache attached, ``follow``; closed at
    shutdown, which ends the streams)."""

    def __init__(self, fleet: Fleet, tenancy: Tenancy | None = None) -> None:
        self.fleet = fleet
        self.tenancy = tenancy or Tenancy()
        self.events = EventHub()
        for member in fleet.members():
            self.follow(member)

    def follow(self, member: EngineMember) -> None:
        """Publish ``member``'s cache events (again: rebinds)."""
        gateway = member.gateway
        self.events.attach(gateway, member.name, lambda: gateway.instance_id)

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        with status_on_error(context):
            call = rpc_call(context)
            scope = self.tenancy.scope(tenant_of(call), request.namespace, request.cache_salt)
            lookup = self.fleet.lookup(scope, convert.prompt(request), call, context.is_active)
            return convert.lookup_response(lookup)

    def Insert(self, request: pb.InsertRequest, context: grpc.ServicerContext) -> pb.InsertResponse:
        with status_on_error(context):
            call = rpc_call(context)
            outcome = self.fleet.insert(
                self.tenancy.scope(tenant_of(call), request.namespace, request.cache_salt),
                list(request.tokens),
                request.session,
                dict(request.metadata),
                call,
                request.engine,
            )
            return convert.insert_response(outcome)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with status_on_error(context):
            where = self.tenancy.visible(tenant_of(call_context(context)))
            return convert.stats_response(self.fleet.stats(where))

    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearResponse:
        with status_on_error(context):
            where = self.tenancy.visible(tenant_of(call_context(context)))
            return pb.ClearResponse(released=self.fleet.clear(where))

    def Generate(
        self, request: pb.GatewayGenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[epb.GenerateEvent]:
        with status_on_error(context):
            call = rpc_call(context)  # the engine stream starts within the caller's deadline
            scope = self.tenancy.scope(tenant_of(call), request.namespace, request.cache_salt)
            call = replace(call, cache_scope=scope)
            gateway_request = replace(
                convert.gateway_request(request, scope), caller_active=context.is_active
            )
            stream = self.fleet.generate(gateway_request, call)
            if not context.add_callback(stream.stop):  # the client went away (already: stop now)
                stream.stop()
            with contextlib.closing(iter(stream)) as events:
                for event in events:
                    yield convert.client_event(event)

    def CacheEvents(
        self, request: pb.CacheEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.CacheEvent]:
        with status_on_error(context):
            where = self.tenancy.visible(tenant_of(call_context(context)))
            self.events.retain(m.gateway for m in self.fleet.members())  # engines that left: gone
            subscription = self.events.subscribe(where, replay=request.replay)
        context.add_callback(subscription.close)  # the client went away: unsubscribe, end the loop
        with subscription:
            for event in subscription:
                yield convert.cache_event(event)


def rpc_call(context: grpc.ServicerContext) -> RpcCall:
    """The call as a value, with the outage allowance its engine calls share (``engine_watch.py``)."""
    return RpcCall.of(call_context(context))


def tenant_of(call: CallContext) -> Tenant:
    """The caller: its owner, authenticated when it presented a valid credential."""
    return Tenant(call.owner, bool(call.credential))
