"""Running the app under uvicorn: in the foreground (``moetrain serve``) or in a background thread (tests,
benchmarks), on a given port or on port 0 (the OS picks one; the bound port is read back from the socket).

uvicorn's HTTP/1.1 protocol (h11) is extended with what a public endpoint needs before any ASGI code runs
(:class:`Limits`): a bound on open connections (one over it is answered 503 with ``Retry-After`` and closed), a
time-out for a request's headers (a connection that opens and sends nothing, or sends its headers byte by byte,
is answered 408 and closed after ``header_timeout_s``; between requests uvicorn's keep-alive time-out applies), and
OpenAI-shaped JSON instead of uvicorn's plain-text 400 for a request that is not HTTP. The body's own time-out and
size limit are the app's (:class:`moetrain.serve.api.RequestGuard`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Connection-level limits of one server.

    Attributes:
        max_connections: most open connections; the next one gets 503 + ``Retry-After: 1`` and is closed.
        header_timeout_s: seconds a request's headers may take to arrive (from the first byte, or from the
            connection's opening for its first request).
        keep_alive_s: seconds an idle kept-alive connection stays open (uvicorn's ``timeout_keep_alive``).
    """

    max_connections: int = 512
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0


def _raw_response(status: int, reason: str, message: str, kind: str, extra: str = "") -> bytes:
    """A complete HTTP/1.1 response with an OpenAI-shaped error body and ``Connection: close``."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode("latin-1") + body


def guarded_protocol(limits: Limits, count: Callable[[str], None] | None = None) -> type:
    """uvicorn's h11 protocol class with ``limits`` enforced; ``count(outcome)`` is called for each connection
    refused (``rejected``) or timed out waiting for headers (``timeout``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(_raw_response(503, "Service Unavailable", f"too many open connections (more than "
                                              f"{limits.max_connections}); retry later", "server_error",
                                              "retry-after: 1\r\n"))
                transport.close()
                if count is not None:
                    count("rejected")
                return
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being served (its body has its own time-out)
            self.transport.write(_raw_response(408, "Request Timeout", f"request headers not received within "
                                               f"{limits.header_timeout_s:g} s", "invalid_request_error"))
            self.transport.close()
            if count is not None:
                count("timeout")

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            if before is None or before.response_complete:  # bytes of a new request: its headers are timed
                self._arm()
            super().data_received(data)
            if self.cycle is not before:  # the headers are complete: a request cycle began
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
                self.transport.close()
                return
            self.transport.write(_raw_response(400, "Bad Request", f"invalid HTTP request: {msg}",
                                               "invalid_request_error"))
            self.transport.close()
            if count is not None:
                count("bad_request")

    return GuardedH11Protocol


class BackgroundServer:
    """uvicorn serving ``app`` in a daemon thread; ``url`` is ``http://host:port`` once :meth:`start` returns.

    Args:
        app: the ASGI app (its ``state.count_outcome``, when set, counts the connections ``limits`` refuse).
        limits: connection-level :class:`Limits`.

    Raises (from start):
        RuntimeError: the server did not start within ``timeout`` seconds.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: Limits | None = None):
        import uvicorn

        limits = limits or Limits()
        count = getattr(getattr(app, "state", None), "count_outcome", None)
        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                     timeout_graceful_shutdown=5, http=guarded_protocol(limits, count),
                                     timeout_keep_alive=int(max(1, limits.keep_alive_s)),
                                     backlog=max(128, limits.max_connections))
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="moetrain-uvicorn", daemon=True)
        self.url = ""

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
