"""Connection-level limits of the serving process (``ConnectionConfig``), on uvicorn's HTTP protocols.

- header read timeout: a connection whose request head is not complete ``header_timeout_s`` after its first byte
  (or after it was opened) is closed: a slow-loris client sending a header byte by byte is cut off;
- header size: more than ``max_header_bytes`` received without a complete head -> 431 and the connection is
  closed (the parser never buffers more); uvicorn has no such bound of its own with httptools (100 kB of headers
  were accepted), h11 has it too (``h11_max_incomplete_event_size``);
- header count: ``serving.gateway`` answers 431 and closes past ``max_headers`` lines (and measures a head that
  arrived whole in one read);
- idle timeout: uvicorn's keep-alive timeout (``idle_timeout_s``) closes a connection idle between requests;
- connections per client address: past ``max_per_client`` open ones (per server process), a new connection from
  that address is answered 503 and closed before it is read (reason ``client_connections``): clients trickling
  request bodies hold connections, and this bounds how many one address can hold (and the bodies buffered for it);
- after a 413 the gateway answers with ``Connection: close`` and the server stops reading the body;
- uvicorn's access log (a line per request) only when ``access_log`` asks for it.
``http_parser`` picks uvicorn's protocol: httptools (C, the faster) or h11 (pure Python); the limits are the same.
What is answered or cut off here, before any application code, is counted in the same metrics as the gateway's
answers (route ``connection``; a head that timed out is a shed request, reason ``header_timeout``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from serving.config import ConnectionConfig
from serving.stats import RESPONSES, SHED


class HeadLimits:
    """Mixin over a uvicorn protocol: a deadline and a byte bound on reading each request head."""

    header_timeout_s = 5.0
    max_header_bytes = 16 * 1024
    max_per_client = 0  # 0: no limit
    open_per_client: Counter  # client address -> open connections (one per protocol class: per server)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._client = None
        if self.max_per_client:
            peer = transport.get_extra_info("peername")
            client = peer[0] if isinstance(peer, tuple) else str(peer)
            if self.open_per_client[client] >= self.max_per_client:
                SHED.labels(reason="client_connections").inc()
                RESPONSES.labels(route="connection", code="503").inc()
                return self._answer_and_close(
                    503, f"more than {self.max_per_client} open connections from one address"
                )
            self._client = client
            self.open_per_client[client] += 1
        self._arm()

    def data_received(self, data: bytes) -> None:
        waiting = self._between_requests()
        if waiting and self._head_timer is None:
            self._arm()  # the first byte of the next request on a kept-alive connection starts its clock
        super().data_received(data)
        if self.transport.is_closing():
            return
        if not self._between_requests():  # the head is complete: a request cycle runs
            self._disarm()
            self._head_bytes = 0
        elif waiting:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse_head()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._client is not None:
            self.open_per_client[self._client] -= 1
            if not self.open_per_client[self._client]:
                del self.open_per_client[self._client]
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            SHED.labels(reason="header_timeout").inc()
            self.transport.close()

    def _refuse_head(self) -> None:
        RESPONSES.labels(route="connection", code="431").inc()
        self._answer_and_close(431, f"the request head exceeds {self.max_header_bytes} bytes")

    def send_400_response(self, msg: str) -> None:
        """The parser's own answer to a malformed request, in the protocol's error shape (uvicorn's is text)."""
        RESPONSES.labels(route="connection", code="400").inc()
        self._answer_and_close(400, f"malformed HTTP request: {msg[:200]}")

    def _answer_and_close(self, status: int, message: str) -> None:
        body = orjson.dumps({"error": message})
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self._disarm()
        self.transport.close()


_REASONS = {400: b"Bad Request", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
PARSERS = {"httptools": HttpToolsProtocol, "h11": H11Protocol}


def protocol_class(cfg: ConnectionConfig) -> type:
    base = PARSERS[cfg.http_parser]
    attrs = {"header_timeout_s": cfg.header_timeout_s, "max_header_bytes": cfg.max_header_bytes,
             "max_per_client": cfg.max_per_client, "open_per_client": Counter()}  # fmt: skip
    return type(f"Limited{base.__name__}", (HeadLimits, base), attrs)


def set_access_log(enabled: bool) -> None:
    """uvicorn's access log on or off: what ``uvicorn.Config(access_log=False)`` does when it configures logging,
    here after the fact (KServe built the Config, and uvicorn's protocols look at the logger's handlers)."""
    access = logging.getLogger("uvicorn.access")
    if not enabled:
        access.handlers = []
        access.propagate = False
    elif not access.hasHandlers():  # asked for, unconfigured: print it like the server's other lines
        access.addHandler(logging.StreamHandler())
        access.propagate = False


def uvicorn_settings(cfg: ConnectionConfig) -> dict:
    """The uvicorn.Config attributes that carry these limits."""
    return {
        "http": protocol_class(cfg),
        "h11_max_incomplete_event_size": cfg.max_header_bytes,
        "timeout_keep_alive": cfg.idle_timeout_s,
    }
