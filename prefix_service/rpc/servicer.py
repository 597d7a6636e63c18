"""PrefixServicer: ``forkline.prefix.v1.PrefixCache`` over a :class:`Fleet` of engine gateways.

Thin: each RPC reads the caller's owner id from the metadata, converts the request to domain values
(``prefix_service/rpc/convert.py``), delegates to the fleet (``prefix_service/fleet/fleet.py``: routing to an
engine) and its gateways (``prefix_service/gateway/gateway.py``, where every flow decision lives:
engine-restart handling, lookup, insert, the gateway Generate with its stop and drain) and converts the answer back. Errors map to status codes in
``engine_service/serving/errors.py``. Engine calls made for an RPC carry its deadline (``caller_deadline``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from engine_service.serving.auth import owner_of
from engine_service.serving.errors import status_on_error
from prefix_service.engines.engine_watch import caller_deadline
from prefix_service.fleet.fleet import Fleet
from prefix_service.rpc import convert
from protos import engine_pb2 as epb
from protos import prefix_pb2 as pb
from protos import prefix_pb2_grpc


class PrefixServicer(prefix_pb2_grpc.PrefixCacheServicer):
    def __init__(self, fleet: Fleet) -> None:
        self.gateway = fleet

    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        with status_on_error(context), caller_deadline(context):
            owner = owner_of(context.invocation_metadata())
            lookup = self.gateway.lookup(request.namespace, convert.prompt(request), owner, context.is_active)
            return convert.lookup_response(lookup)

    def Insert(self, request: pb.InsertRequest, context: grpc.ServicerContext) -> pb.InsertResponse:
        with status_on_error(context), caller_deadline(context):
            owner = owner_of(context.invocation_metadata())
            outcome = self.gateway.insert(
                request.namespace,
                list(request.tokens),
                request.session,
                dict(request.metadata),
                owner,
                request.engine,
            )
            return convert.insert_response(outcome)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        with status_on_error(context):
            return convert.stats_response(self.gateway.stats())

    def Clear(self, request: pb.ClearRequest, context: grpc.ServicerContext) -> pb.ClearResponse:
        with status_on_error(context), caller_deadline(context):
            return pb.ClearResponse(released=self.gateway.clear())

    def Generate(
        self, request: pb.GatewayGenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[epb.GenerateEvent]:
        with status_on_error(context):
            owner = owner_of(context.invocation_metadata())
            with caller_deadline(context):  # the engine stream gets the caller's deadline
                stream = self.gateway.generate(convert.gateway_request(request), owner)
            context.add_callback(stream.stop)  # the client went away
            with contextlib.closing(iter(stream)) as events:
                for event in events:
                    yield convert.client_event(event)
