"""The witness's HTTP edge: `POST /add-checkpoint` (c2sp.org/tlog-witness) on the standard
library's ThreadingHTTPServer, so that a security team runs it with nothing but Python and
`cryptography`.

Responses, as the spec's section "add-checkpoint" gives them: 200 with the cosignature line
(`text/plain`), 409 with the latest cosigned size (`text/x.tlog.size`) or a split view, 422 for
a proof that does not verify, 403 for an untrusted signature, 404 for an unknown log, 400 for a
malformed body. Beyond the spec: 411 without a Content-Length, 413 over MAX_REQUEST_BYTES, 404
for any other path, 405 for any other method. A client has CLIENT_TIMEOUT_S to send its request.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from audit.cosignature import Cosigner
from audit.errors import OldSizeConflictError, WitnessRefusedError, WitnessStateError
from audit.note import VerifierKey
from audit.witness import MAX_REQUEST_BYTES, Witness

logger = logging.getLogger(__name__)

ADD_CHECKPOINT_PATH = "/add-checkpoint"
SIZE_CONTENT_TYPE = "text/x.tlog.size"
CLIENT_TIMEOUT_S = 10.0


class _Handler(BaseHTTPRequestHandler):
    server: WitnessServer
    protocol_version = "HTTP/1.1"  # keep-alive, as the spec asks clients and witnesses to use
    timeout = CLIENT_TIMEOUT_S

    def do_POST(self) -> None:
        if self.path != ADD_CHECKPOINT_PATH:
            self._reply(HTTPStatus.NOT_FOUND, f"no such endpoint; POST {ADD_CHECKPOINT_PATH}\n")
            return
        length = self.headers.get("Content-Length")
        if length is None or not (length.isascii() and length.isdigit()):
            self._reply(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is required\n")
            return
        if int(length) > MAX_REQUEST_BYTES:
            self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"at most {MAX_REQUEST_BYTES} bytes\n")
            self.close_connection = True
            return
        try:
            body = self.rfile.read(int(length))
        except TimeoutError:
            self.close_connection = True  # too slow to send its request: no answer
            return
        try:
            line = self.server.witness.add_checkpoint(body, now=int(time.time()))
        except OldSizeConflictError as exc:
            self._reply(HTTPStatus.CONFLICT, f"{exc.latest_size}\n", SIZE_CONTENT_TYPE)
        except WitnessRefusedError as exc:
            logger.info("add-checkpoint refused (%d): %s", exc.status, exc)
            self._reply(HTTPStatus(exc.status), f"{exc}\n")
        except OSError as exc:
            # The state could not be recorded: nothing was cosigned.
            logger.error("witness state could not be written: %s", exc)
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, "the witness could not record its state\n")
        else:
            self._reply(HTTPStatus.OK, line)

    def _refuse_method(self) -> None:
        self._reply(HTTPStatus.METHOD_NOT_ALLOWED, f"POST {ADD_CHECKPOINT_PATH} only\n")

    do_GET = do_PUT = do_DELETE = do_HEAD = _refuse_method

    def _reply(self, status: HTTPStatus, body: str, content_type: str = "text/plain") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", f"{content_type}; charset=utf-8"
                         if content_type == "text/plain" else content_type)  # fmt: skip
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        logger.info("%s %s", self.address_string(), format % args)


class WitnessServer(ThreadingHTTPServer):
    """Serves one Witness; holds an exclusive lock on its state file while it lives, so that
    two witness processes never share (and roll back) one state."""

    daemon_threads = True

    def __init__(
        self,
        cosigner: Cosigner,
        logs: Sequence[VerifierKey],
        state_path: Path,
        address: tuple[str, int],
    ) -> None:
        lock_path = state_path.with_name(state_path.name + ".lock")
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise WitnessStateError(
                f"another witness process holds {lock_path}: one state, one witness"
            ) from None
        try:
            # Read the state only once no other witness process can change it.
            self.witness = Witness(cosigner, logs, state_path)
            super().__init__(address, _Handler)
        except BaseException:
            os.close(self._lock_fd)
            raise

    def server_close(self) -> None:
        super().server_close()
        os.close(self._lock_fd)
