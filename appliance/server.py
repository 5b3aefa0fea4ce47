"""Serving the app over a real socket: TLS always (plain HTTP only behind
`server.insecure_http`), uvicorn, and a graceful drain on SIGTERM.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections at once, lets the requests in flight
finish for up to `server.drain_timeout_s`, cancels what is left (which aborts it in the engine),
stops the engine, and exits.

The server's life is logged at any log.level (appliance.logs): where it serves, once at start;
`ready` (appliance.api.readiness); `stopping` when a signal starts the drain; `stopped` once
the drain, the engine and the audit log's final checkpoint are done.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from appliance.config import ServerSettings, Settings
from appliance.errors import ConfigError
from appliance.tls import (
    certificate_fingerprint,
    ensure_self_signed_certificate,
    verify_certificate_pair,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Listener:
    """A bound listening socket and how clients reach it."""

    sock: socket.socket
    url: str
    # SHA-256 of the certificate, for clients that pin it; None over plain HTTP.
    fingerprint: str | None


def listen(settings: Settings) -> Listener:
    """Prepare TLS (making the self-signed pair if configured so) and bind the socket, so that
    every start-up error surfaces before serving, and the real port is known (`port = 0`)."""
    fingerprint = _prepare_tls(settings)
    server = settings.server
    sock = _bind(server)
    host, port = server.host, sock.getsockname()[1]
    scheme = "http" if server.insecure_http else "https"
    shown_host = f"[{host}]" if ":" in host else host
    return Listener(sock, f"{scheme}://{shown_host}:{port}", fingerprint)


def uvicorn_server(settings: Settings, app: ASGIApp) -> uvicorn.Server:
    tls = settings.tls
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        ssl_certfile=None if settings.server.insecure_http else tls.cert_file,
        ssl_keyfile=None if settings.server.insecure_http else tls.key_file,
        timeout_graceful_shutdown=settings.server.drain_timeout_s,
        http=_HttpProtocol,
        lifespan="on",
        log_config=None,  # the process's logging, as configured by the command
        access_log=False,
        server_header=False,
    )
    return _Server(config)


def serve(settings: Settings, app: ASGIApp, listener: Listener) -> None:
    """Serve until SIGTERM or SIGINT, then drain (see the module docstring). Blocks."""
    if settings.server.insecure_http:
        logger.warning("serving plain HTTP without TLS (server.insecure_http = true)")
    logger.info("serving %s on %s", settings.served_model_name, listener.url)
    if listener.fingerprint is not None:
        logger.info("TLS certificate SHA-256 %s", listener.fingerprint)
    uvicorn_server(settings, app).run(sockets=[listener.sock])


class _Server(uvicorn.Server):
    """uvicorn's server, saying when its shutdown starts and when it is over."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timeout_s = self.config.timeout_graceful_shutdown
        logger.info(
            "stopping: no new connections; requests in flight have %s s to finish", timeout_s
        )
        await super().shutdown(sockets)
        logger.info("stopped")


class _HttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol, except that a drain drops idle keep-alive connections at
    once. uvicorn closes them with a TLS close handshake that waits up to 30 s for the client's
    close_notify, which an idle client (a pooled connection) does not send until it next uses
    the connection: every drain would last its whole timeout for nothing."""

    def shutdown(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self.transport.abort()
        else:
            super().shutdown()  # in flight: finish this response, then close


def _prepare_tls(settings: Settings) -> str | None:
    if settings.server.insecure_http:
        return None
    tls = settings.tls
    assert tls.cert_file is not None and tls.key_file is not None, "checked by Settings"
    # Attested (tee.mode = required): a fresh pair at each start, made inside the TEE, whose key
    # every attestation binds (attestation.binding.Channel).
    fresh = settings.tee.mode == "required"
    if tls.self_signed and ensure_self_signed_certificate(
        tls.cert_file, tls.key_file, [settings.server.host], fresh=fresh
    ):
        logger.warning("made a self-signed TLS certificate at %s", tls.cert_file)
    verify_certificate_pair(tls.cert_file, tls.key_file)
    return certificate_fingerprint(tls.cert_file)


def _bind(server: ServerSettings) -> socket.socket:
    family = socket.AF_INET6 if ":" in server.host else socket.AF_INET
    try:
        return socket.create_server((server.host, server.port), family=family, backlog=2048)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on server.host = {server.host!r}, server.port = {server.port}: "
            f"{exc.strerror or exc}; choose another address or port"
        ) from exc
