"""Authentication on the wire: who a call is (:func:`call_context`), the bearer-token interceptor, TLS
credentials, and the metadata a client (or the prefix service acting for a caller) sends.

With a token table every call but health and reflection needs ``authorization: Bearer <token>``
(else UNAUTHENTICATED before the handler runs); without one, owners come from ``forkline-owner``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from engine_service.api.call_context import CallContext
from engine_service.api.errors import InvalidArgument, Unauthenticated
from engine_service.api.owners import DEFAULT_OWNER, check_owner
from engine_service.serving.errors import status_on_error
from engine_service.serving.tokens import TokenTable, check_token

log = logging.getLogger(__name__)

OWNER_METADATA_KEY = "forkline-owner"
AUTHORIZATION_KEY = "authorization"
BEARER = "bearer"
# Open without a token: Kubernetes-style probes and tooling.
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
_NO_DEADLINE_S = 1e9  # grpc reports "no deadline" as a time remaining of ~9e18 s


class AuthenticatedContext:
    """A handler's ``grpc.ServicerContext`` that carries the caller the interceptor authenticated
    (``caller``: owner and credential, no deadline); everything else is the wrapped context's."""

    def __init__(self, context: grpc.ServicerContext, caller: CallContext) -> None:
        self._context = context
        self.caller = caller

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def owner_of(context: grpc.ServicerContext) -> str:
    """The caller's owner id: the authenticated owner (auth on; the header is then ignored), else the
    ``forkline-owner`` metadata; absent -> ``anonymous``."""
    if isinstance(context, AuthenticatedContext):
        return context.caller.owner
    for key, value in context.invocation_metadata() or ():
        if key == OWNER_METADATA_KEY:
            return check_owner(value.decode() if isinstance(value, bytes) else str(value), OWNER_METADATA_KEY)
    return DEFAULT_OWNER


def piece_scope(context: grpc.ServicerContext, cache_scope: str | None) -> str:
    """Whose cache of text pieces a Tokenize reads: the caller's owner, or with ``cache_scope`` that
    scope under the authenticated owner (auth off: owners are self-declared, the scope is taken as
    given -- the prefix service's unauthenticated callers, an owner each, share their scope's pieces)."""
    if cache_scope is None:
        return owner_of(context)
    owner = context.caller.owner if isinstance(context, AuthenticatedContext) else ""
    return json.dumps([owner, cache_scope])


def call_context(context: grpc.ServicerContext) -> CallContext:
    """The call as a value: its owner (:func:`owner_of`), the credential it authenticated with ("":
    auth off) and its deadline (``time.monotonic()``; None when the client set none)."""
    remaining = context.time_remaining()
    deadline = None if remaining is None or remaining > _NO_DEADLINE_S else time.monotonic() + remaining
    credential = context.caller.credential if isinstance(context, AuthenticatedContext) else ""
    return CallContext(owner_of(context), credential, deadline)


def authenticate(table: TokenTable, metadata: Sequence[tuple[str, str | bytes]] | None) -> CallContext:
    """The caller ``metadata`` authenticates as (its credential: the ``authorization`` value);
    Unauthenticated saying what is wrong otherwise."""
    values = [v for k, v in metadata or () if k == AUTHORIZATION_KEY]
    if not values:
        declared = any(k == OWNER_METADATA_KEY for k, _ in metadata or ())
        hint = f" ({OWNER_METADATA_KEY} alone is not a credential)" if declared else ""
        raise Unauthenticated(f"missing '{AUTHORIZATION_KEY}: Bearer <token>' metadata{hint}")
    if len(values) > 1:
        raise Unauthenticated(f"{AUTHORIZATION_KEY} metadata given {len(values)} times; send it once")
    value = values[0].decode() if isinstance(values[0], bytes) else values[0]
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != BEARER or not token.strip():
        raise Unauthenticated(f"malformed {AUTHORIZATION_KEY} metadata: expected 'Bearer <token>'")
    try:
        token = check_token(token.strip(), "bearer token")
    except InvalidArgument as exc:
        raise Unauthenticated(f"malformed {AUTHORIZATION_KEY} metadata: {exc}") from None
    owner = table.owner_for(token)
    if owner is None:
        raise Unauthenticated("unknown bearer token")
    return CallContext(owner, value)


def rebuild_handler(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Callable[..., Any], bool], Callable[..., Any]]
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour wrapped (``wrap(behaviour, streams_responses)``)."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True), **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False), **codec)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **codec)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Authenticates every call but health and reflection against ``table``; the handler gets an
    :class:`AuthenticatedContext`."""

    def __init__(self, table: TokenTable) -> None:
        self.table = table

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        try:
            caller = authenticate(self.table, handler_call_details.invocation_metadata)
        except Unauthenticated as exc:
            log.debug("refused %s: %s", handler_call_details.method, exc)
            refuse = _refusal(exc)
            return rebuild_handler(handler, lambda _behaviour, _streams: refuse)
        return rebuild_handler(handler, lambda behaviour, _streams: _as_caller(caller, behaviour))


def _refusal(exc: Unauthenticated) -> Callable[..., Any]:
    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        with status_on_error(context):
            raise exc

    return refuse


def _as_caller(caller: CallContext, behaviour: Callable[..., Any]) -> Callable[..., Any]:
    def run(request: Any, context: grpc.ServicerContext) -> Any:
        return behaviour(request, AuthenticatedContext(context, caller))

    return run


def _read_pem(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{flag}: cannot read {path} ({exc.strerror or exc})") from None


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS server credentials from PEM files; with ``client_ca`` clients must present a certificate
    signed by it (mutual TLS)."""
    ca = _read_pem(client_ca, "--tls_client_ca") if client_ca else None
    return grpc.ssl_server_credentials(
        [(_read_pem(key, "--tls_key"), _read_pem(cert, "--tls_cert"))],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


@dataclass(frozen=True)
class ServerSecurity:
    """What a server enforces: a token table (auth on) and/or TLS credentials."""

    tokens: TokenTable | None = None
    credentials: grpc.ServerCredentials | None = None

    @property
    def authenticates(self) -> bool:
        return self.tokens is not None

    def interceptors(self) -> tuple[grpc.ServerInterceptor, ...]:
        return (TokenAuthInterceptor(self.tokens),) if self.tokens is not None else ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSecurity:
        """From the flags of ``service_main.add_auth_arguments``; InvalidArgument naming a bad flag."""
        if bool(args.tls_cert) != bool(args.tls_key):
            raise InvalidArgument("--tls_cert and --tls_key must be given together")
        if args.tls_client_ca and not args.tls_cert:
            raise InvalidArgument("--tls_client_ca needs --tls_cert and --tls_key")
        tokens = TokenTable.load(args.auth_tokens) if args.auth_tokens else None
        creds = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        return cls(tokens, creds)


@dataclass(frozen=True)
class ClientSecurity:
    """What a client presents: a bearer token and/or TLS (the CA that signed the server's certificate,
    and a client certificate and key for mutual TLS). All None: a plain channel, no token."""

    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if self.token is not None:
            check_token(self.token, "token")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("a client certificate and its key must be given together")
        if self.tls_cert and not self.tls_ca:
            raise InvalidArgument("a client certificate needs the server's CA (tls_ca) too")

    def channel(self, target: str, options: Sequence[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A channel to ``target``: TLS when ``tls_ca`` is set, else plain."""
        if not self.tls_ca:
            return grpc.insecure_channel(target, options=options)
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.tls_ca, "tls_ca"),
            private_key=_read_pem(self.tls_key, "tls_key") if self.tls_key else None,
            certificate_chain=_read_pem(self.tls_cert, "tls_cert") if self.tls_cert else None,
        )
        return grpc.secure_channel(target, creds, options=options)

    def metadata(self, owner: str) -> tuple[tuple[str, str], ...]:
        """The call metadata: ``forkline-owner`` (what a server without tokens uses) and, with a token,
        ``authorization: Bearer <token>`` (what a server with tokens uses; it ignores the header)."""
        if self.token is None:
            return ((OWNER_METADATA_KEY, owner),)
        return ((OWNER_METADATA_KEY, owner), (AUTHORIZATION_KEY, f"Bearer {self.token}"))


def on_behalf_of(call: CallContext) -> tuple[tuple[str, str], ...]:
    """Metadata for an engine call the prefix service makes for ``call``: its owner header (what an
    engine without tokens reads) and, when it authenticated, its own ``authorization`` (the engine
    checks it)."""
    if call.credential:
        return ((OWNER_METADATA_KEY, call.owner), (AUTHORIZATION_KEY, call.credential))
    return ((OWNER_METADATA_KEY, call.owner),)
