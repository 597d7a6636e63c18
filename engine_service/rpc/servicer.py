"""EngineServicer: ``forkline.engine.v1.Engine`` over :class:`EngineSessions`. Each RPC converts its
request (``convert.py``), delegates with the caller's owner id (``serving.auth.owner_of``) and converts
the answer; errors map to status codes in ``serving/errors.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from engine_service.rpc import convert
from engine_service.serving import engine_wire
from engine_service.serving.auth import owner_of, piece_scope
from engine_service.serving.errors import status_on_error
from engine_service.sessions.engine import EngineSessions
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """See the module docstring."""

    def __init__(self, sessions: EngineSessions) -> None:
        self.sessions = sessions

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateEvent]:
        with status_on_error(context):
            s = self.sessions
            owner = owner_of(context)
            call = s.generate(owner, convert.generation_request(request, s.eos_token_ids, s.hidden_size))
            context.add_callback(call.finish)  # the call ends however the stream ends
            try:
                for event in call.events(context.is_active):
                    yield engine_wire.event_message(event)
            finally:
                call.finish()

    def Clone(self, request: pb.CloneRequest, context: grpc.ServicerContext) -> pb.CloneResponse:
        with status_on_error(context):
            taken = self.sessions.clone(
                owner_of(context),
                request.session,
                request.upto,
                new_owner=request.new_owner,
                expected_digest=request.expected_content_digest,
                wanted=context.is_active,
            )
            return convert.clone_response(taken, request.upto)

    def Close(self, request: pb.CloseRequest, context: grpc.ServicerContext) -> pb.CloseResponse:
        with status_on_error(context):
            self.sessions.close(owner_of(context), request.session)
            return pb.CloseResponse()

    def Claim(self, request: pb.ClaimRequest, context: grpc.ServicerContext) -> pb.ClaimResponse:
        with status_on_error(context):
            self.sessions.claim(owner_of(context), request.session)
            return pb.ClaimResponse()

    def ReleaseOwner(
        self, request: pb.ReleaseOwnerRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseOwnerResponse:
        with status_on_error(context):
            released = self.sessions.release_owner(
                owner_of(context), request.keep, paid_only=request.paid_only
            )
            return pb.ReleaseOwnerResponse(released=released)

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        with status_on_error(context):
            described = self.sessions.describe(owner_of(context), request.session)
            return convert.describe_response(described)

    def ExportSession(
        self, request: pb.ExportSessionRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.SnapshotChunk]:
        with status_on_error(context):
            owner = owner_of(context)
            yield from convert.snapshot_chunks(
                self.sessions.export_session(
                    owner, request.session, request.extra, request.upto if request.HasField("upto") else None
                )
            )

    def ImportSession(
        self, request_iterator: Iterator[pb.SnapshotChunk], context: grpc.ServicerContext
    ) -> pb.ImportSessionResponse:
        with status_on_error(context):
            owner = owner_of(context)
            imported = self.sessions.import_session(owner, (chunk.data for chunk in request_iterator))
            return convert.import_response(imported)

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        with status_on_error(context):
            return engine_wire.info_message(self.sessions.info(owner_of(context)))

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        with status_on_error(context):
            prompt = engine_wire.text_prompt(request.text)
            scope = piece_scope(context, request.cache_scope if request.HasField("cache_scope") else None)
            tokenized = self.sessions.tokenize(prompt, request.message_ends, scope)
            return engine_wire.tokenize_response(tokenized)

    def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.ServicerContext
    ) -> pb.DetokenizeResponse:
        with status_on_error(context):
            return pb.DetokenizeResponse(text=self.sessions.detokenize(request.ids))
