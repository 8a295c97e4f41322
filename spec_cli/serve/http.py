"""The HTTP layer of `spec serve-target`: standard-library `ThreadingHTTPServer`, bytes in and out.

It reads the body (bounded by Content-Length and the server's limit), hands it to
`TargetServer.handle`, writes the answer and then runs the answer's `after` hook (the last client's
goodbye stops the server only once its answer is flushed).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from spec_cli.serve.server import Response, TargetServer

log = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a trainer reuses one connection per thread
    server_version = "spec-serve-target"
    sys_version = ""
    default_request_version = "HTTP/1.0"  # error answers to broken request lines get a status line
    server: _HTTPServer

    def setup(self) -> None:
        self.timeout = self.server.request_timeout  # bounds every read: idle, headers and body
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        log.debug("%s %s", self.address_string(), format % args)

    def parse_request(self) -> bool:
        self._answered = False
        ok = super().parse_request()
        if not ok and not self._answered:  # an empty request line: the base class just hangs up
            self.send_error(HTTPStatus.BAD_REQUEST, "empty request line")
        return ok

    def send_error(self, code, message=None, explain=None) -> None:
        """The base class's own errors (bad request line, headers too long, unknown method) in JSON,
        always as a 4xx: they are the client's mistakes."""
        if code == HTTPStatus.NOT_IMPLEMENTED:
            code, message = (
                HTTPStatus.METHOD_NOT_ALLOWED,
                f"method {self.command!r} is not supported",
            )
        elif code == HTTPStatus.HTTP_VERSION_NOT_SUPPORTED:
            code, message = (
                HTTPStatus.BAD_REQUEST,
                f"{message} (this server speaks HTTP/1.0 and 1.1)",
            )
        self.close_connection = True
        self._write(
            Response.json(
                {"error": message or HTTPStatus(code).phrase, "status": int(code)},
                int(code),
                close=True,
            )
        )
        self._drain()

    def do_GET(self) -> None:
        self._handle()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def _handle(self) -> None:
        logic = self.server.logic
        with self.server.track():  # a graceful stop waits for this
            response = self._read_and_answer(logic)
            self._write(response)
            if response.after is not None:
                response.after()
        if response.close and response.status >= 400:
            self._drain()

    def _drain(self, max_bytes: int = 16 << 20, seconds: float = 2.0) -> None:
        """Read (and drop) what the client still sends before closing, briefly: closing a socket
        with unread data resets the connection, and the client would lose our error answer."""
        deadline = time.monotonic() + seconds
        try:
            while max_bytes > 0 and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(min(max_bytes, 1 << 20))
                if not chunk:
                    break
                max_bytes -= len(chunk)
        except OSError:
            pass

    def _read_and_answer(self, logic: TargetServer) -> Response:
        if self.headers.get("Transfer-Encoding"):
            return _error(411, "send the body with a Content-Length (no chunked transfer encoding)")
        raw = self.headers.get("Content-Length")
        if raw is None:
            if self.command == "POST":
                return _error(411, "a POST needs a Content-Length header")
            length = 0
        else:
            try:
                length = int(raw)
            except ValueError:
                return _error(400, f"Content-Length {raw[:40]!r} is not an integer")
            if length < 0:
                return _error(400, "Content-Length is negative")
        if not logic.authorized(self.headers.get("Authorization")):
            # refuse before reading (or buffering) anything an unauthenticated peer sends
            return logic.handle(self.command, self.path, self.headers, b"")
        if length > logic.limits.max_body_bytes:
            return _error(
                413,
                f"body of {length} bytes exceeds the limit of "
                f"{logic.limits.max_body_bytes} (--max-body-bytes)",
            )
        body = bytearray(length)
        view, got = memoryview(body), 0
        try:
            while got < length:
                n = self.rfile.readinto(view[got:])
                if not n:
                    break
                got += n
        except TimeoutError:
            return _error(408, f"timed out reading the body ({got} of {length} bytes)")
        except OSError as exc:
            return _error(400, f"could not read the body: {exc}")
        if got < length:
            return _error(400, f"truncated body: {got} of {length} bytes")
        try:
            address = self.connection.getsockname()[0]  # this server as the client reached it
        except OSError:
            address = None
        return logic.handle(self.command, self.path, self.headers, body, address)

    def _write(self, response: Response) -> None:
        self._answered = True
        try:
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(response.nbytes))
            for key, value in response.headers.items():
                self.send_header(key, value)
            if response.close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            for part in response.parts:
                self.wfile.write(part)
            self.wfile.flush()
        except OSError as exc:  # the client went away: nothing to answer
            log.info("could not send the answer to %s: %s", self.client_address[0], exc)
            self.close_connection = True
            response.after = None


def _error(status: int, message: str) -> Response:
    return Response.json({"error": message, "status": status}, status, close=True)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # idle keep-alive connections must not hold up the exit
    allow_reuse_address = True

    def __init__(self, address, logic: TargetServer, request_timeout: float):
        self.logic = logic
        self.request_timeout = request_timeout
        self._active = 0
        self._idle = threading.Condition()
        super().__init__(address, _Handler)

    def handle_error(self, request, client_address) -> None:
        """socketserver prints a traceback for any error in a connection's thread. A client that reset or
        dropped its connection (a trainer killed mid-request) is an ordinary event: one log line."""
        exc = sys.exc_info()[1]
        if isinstance(
            exc, (ConnectionError, TimeoutError)
        ):  # reset, broken pipe, aborted, timed out
            log.info("connection from %s ended mid-request: %s", client_address[0], exc)
            return
        super().handle_error(request, client_address)

    def track(self):
        server = self

        class _Track:
            def __enter__(self):
                with server._idle:
                    server._active += 1

            def __exit__(self, *exc):
                with server._idle:
                    server._active -= 1
                    server._idle.notify_all()

        return _Track()

    def wait_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self._active == 0, timeout)


class HTTPHandle:
    """A running HTTP server (serve_forever in a background thread)."""

    def __init__(
        self,
        logic: TargetServer,
        host: str = "127.0.0.1",
        port: int = 8000,
        request_timeout: float = 120.0,
    ):
        self.logic = logic
        self.httpd = _HTTPServer((host, port), logic, request_timeout)
        self.host = host
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="spec-serve-http",
            daemon=True,
        )
        self.thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, grace: float = 30.0) -> None:
        """Stop accepting, let requests in progress finish (up to `grace` seconds), close."""
        self.logic.shutdown_event.set()  # requests that still arrive get 503
        self.httpd.shutdown()
        if not self.httpd.wait_idle(grace):
            log.warning("requests still running after %.0f s; closing anyway", grace)
        self.httpd.server_close()
        self.logic.close()
