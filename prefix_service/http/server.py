"""The HTTP door's server: uvicorn on a background thread of the prefix service process; ``stop(grace)``
lets requests finish for ``grace`` seconds, then cancels the rest (ending their engine generations)."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

import uvicorn
from starlette.types import ASGIApp

from engine_service.api.errors import InvalidArgument, Unavailable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0


class HttpServer:
    def __init__(self, server: uvicorn.Server, thread: threading.Thread, sock: socket.socket) -> None:
        self._server, self._thread, self._socket = server, thread, sock
        self.host, self.port = sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._stopped = False

    @classmethod
    def start(
        cls,
        app: ASGIApp,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
    ) -> HttpServer:
        """Serve ``app`` on ``host:port``; with ``tls_cert`` + ``tls_key`` over HTTPS (and with
        ``tls_client_ca``, clients must present a certificate it signed: the gRPC side's TLS flags)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY on accepted connections only for sockets
        # created so (proto 0 leaves Nagle on: +40 ms per response with a delayed ACK)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            sock.close()
            raise Unavailable(f"cannot bind the HTTP port {host}:{port}: {exc}") from None
        if bool(tls_cert) != bool(tls_key) or (tls_client_ca and not tls_cert):
            sock.close()
            raise InvalidArgument("HTTPS needs a certificate and its key (and a client CA only with them)")
        tls = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key} if tls_cert else {}
        if tls_client_ca:
            tls |= {"ssl_ca_certs": tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=None, **tls
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="forkline-http", daemon=True
        )
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        http = cls(server, thread, sock)
        if not server.started:
            http.stop(0)
            raise Unavailable(f"the HTTP server on {host}:{port} did not start")
        log.info("OpenAI-compatible HTTP on %s:%d", http.host, http.port)
        return http

    def stop(self, grace: float | None = 2.0) -> None:
        """Stop accepting; requests in flight get ``grace`` seconds (None: as long as they need)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        # (a zero timeout would report cancelling even when nothing runs)
        self._server.config.timeout_graceful_shutdown = None if grace is None else max(grace, 0.05)
        self._server.should_exit = True
        self._thread.join()
        self._socket.close()
