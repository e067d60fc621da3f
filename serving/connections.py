"""Connection-level limits of the serving process (``ConnectionConfig``), on uvicorn's h11 protocol.

- header size: h11 buffers at most ``max_header_bytes`` of an incomplete request head, then answers 400 and
  closes (uvicorn's default httptools parser has no such bound: 100 kB of headers were accepted); a head that
  arrives whole in one read is measured by ``serving.gateway`` (431, closed);
- header count: ``serving.gateway`` answers 431 and closes past ``max_headers`` lines;
- header read timeout: a connection whose request head is not complete ``header_timeout_s`` after its first byte
  (or after it was opened) is closed: a slow-loris client sending a header byte by byte is cut off;
- idle timeout: uvicorn's keep-alive timeout (``idle_timeout_s``) closes a connection idle between requests;
- after a 413 the gateway answers with ``Connection: close`` and the server stops reading the body.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.config import ConnectionConfig


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline on reading each request head."""

    header_timeout_s = 5.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self._between_requests():
            self._arm()  # the first byte of the next request on a kept-alive connection starts its clock
        super().data_received(data)
        if self._head_timer is not None and not self._between_requests():
            self._head_timer.cancel()  # the head is complete: a request cycle runs
            self._head_timer = None

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


def protocol_class(cfg: ConnectionConfig) -> type[H11Protocol]:
    return type("GemflowH11Protocol", (HeaderTimeoutProtocol,), {"header_timeout_s": cfg.header_timeout_s})


def uvicorn_settings(cfg: ConnectionConfig) -> dict:
    """The uvicorn.Config attributes that carry these limits."""
    return {
        "http": protocol_class(cfg),
        "h11_max_incomplete_event_size": cfg.max_header_bytes,
        "timeout_keep_alive": cfg.idle_timeout_s,
    }
