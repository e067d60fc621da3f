"""Connection-level limits with real sockets against running servers (``serving.connections``: the shared
server on httptools and uvloop, the defaults, and a second one on h11 and asyncio's own loop, both with
``header_timeout_s=1`` and ``idle_timeout_s=2``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import urllib.parse
import urllib.request

import pytest

from serving.config import EVENT_LOOPS, ConnectionConfig, ServingConfig
from serving.server import loop_factory
from tests.serving.conftest import SERVER_SETTINGS
from tests.serving.world import MODEL, free_port, running_server

pytestmark = pytest.mark.integration
LIVE = b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n"
PREDICT = (
    f"POST /v1/models/{MODEL}:predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n".encode()
)


@pytest.fixture(scope="module")
def h11_log(tmp_path_factory):
    return tmp_path_factory.mktemp("h11-log") / "serve.log"


@pytest.fixture(scope="module", params=["httptools", "h11"])
def conn_server(request, world, h11_log):
    if request.param == "httptools":  # the default: the shared server (no access log)
        yield request.getfixturevalue("server")
        return
    settings = (*SERVER_SETTINGS, "connections.http_parser=h11", "connections.access_log=true",
                "connections.event_loop=asyncio")  # fmt: skip
    with running_server(world, free_port(), h11_log, *settings) as base:
        yield base


def connect(base: str) -> socket.socket:
    url = urllib.parse.urlsplit(base)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float = 10.0) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (s from now)."""
    t0, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data, time.monotonic() - t0


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head + Content-Length body) from a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(v)
        for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
        if k.lower() == b"content-length"
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def test_the_access_log_is_written_only_when_asked_for(conn_server, request, server_log, h11_log):
    """Off by default (the httptools server); ``connections.access_log=true`` (the h11 server): a line a request."""
    asked = request.node.callspec.params["conn_server"] == "h11"
    marker = f"access-marker-{time.monotonic_ns()}"
    with contextlib.closing(connect(conn_server)) as sock:
        sock.sendall(f"GET /v2/health/live?{marker} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        assert status_of(read_response(sock)) == 200
    time.sleep(0.3)
    log = h11_log if asked else server_log
    lines = [ln for ln in log.read_text().splitlines() if marker in ln]
    assert len(lines) == (1 if asked else 0), lines


def test_each_server_runs_the_event_loop_it_was_given(conn_server, request, server_log, h11_log):
    other = request.node.callspec.params["conn_server"] == "h11"
    log = (h11_log if other else server_log).read_text()
    assert f"({'asyncio' if other else 'uvloop'} event loop)" in log


def test_slow_loris_is_cut_off(conn_server):
    sock = connect(conn_server)
    t0, closed = time.monotonic(), False
    try:
        for byte in LIVE + b"X-Slow: " + b"a" * 200:
            sock.send(bytes([byte]))
            time.sleep(0.1)
            if time.monotonic() - t0 > 8:
                break
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    if not closed:
        data, _ = read_until_closed(sock, 2)
        closed = data == b""
    assert closed and time.monotonic() - t0 < 4, time.monotonic() - t0  # header_timeout_s=1
    with urllib.request.urlopen(f"{conn_server}/metrics", timeout=5) as resp:
        assert 'gemflow_ranker_shed_total{reason="header_timeout"}' in resp.read().decode()


def test_a_silent_connection_is_closed(conn_server):
    sock = connect(conn_server)
    data, took = read_until_closed(sock)
    assert data == b"" and took < 3


def test_an_idle_keep_alive_connection_is_closed(conn_server):
    sock = connect(conn_server)
    sock.sendall(LIVE + b"\r\n")
    assert status_of(read_response(sock)) == 200
    sock.sendall(LIVE + b"\r\n")  # keep-alive works: a second request on the same connection
    assert status_of(read_response(sock)) == 200
    data, took = read_until_closed(sock)
    assert data == b"" and 1 < took < 4  # idle_timeout_s=2


@pytest.mark.parametrize(
    "head",
    [
        LIVE + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        LIVE + b"".join(b"X-%d: 1\r\n" % i for i in range(2000)) + b"\r\n",
    ],
    ids=["100kB_header", "2000_headers"],
)
def test_oversized_heads_are_refused_and_closed(conn_server, head):
    sock = connect(conn_server)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed while still sending: refused
        sock.sendall(head)
    data, _ = read_until_closed(sock)
    assert data == b"" or status_of(data) in (400, 431), data[:200]


def test_413_on_a_declared_length_closes_without_reading(conn_server):
    sock = connect(conn_server)
    sock.sendall(PREDICT + b"Content-Length: 104857600\r\n\r\n")
    data, took = read_until_closed(sock)
    assert status_of(data) == 413 and b"connection: close" in data.lower() and took < 3


def test_413_on_a_chunked_body_stops_reading_and_closes(conn_server):
    sock = connect(conn_server)
    sock.sendall(PREDICT + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk, sent = b"%x\r\n" % 65536 + b"a" * 65536 + b"\r\n", 0
    sock.settimeout(2)
    try:
        while sent < 100 << 20:
            sock.sendall(chunk)
            sent += 65536
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    assert sent < 50 << 20, sent  # the server stopped taking the body long before its 100 MiB
    data, _ = read_until_closed(sock, 3)
    assert data == b"" or status_of(data) == 413, data[:200]


@pytest.mark.parametrize("name", EVENT_LOOPS)
def test_the_event_loop_is_the_one_configured(name):
    factory = loop_factory(
        ServingConfig(connections=ConnectionConfig(event_loop=name)).connections.event_loop
    )
    with asyncio.Runner(loop_factory=factory) as runner:
        loop = runner.get_loop()
        assert type(loop).__module__.split(".")[0] == ("uvloop" if name == "uvloop" else "asyncio")
        assert runner.run(asyncio.sleep(0, result=7)) == 7
    with pytest.raises(ValueError, match="connections.event_loop must be uvloop or asyncio"):
        ServingConfig(connections=ConnectionConfig(event_loop="trio"))


def test_a_request_target_past_the_head_limit_is_refused_even_in_one_read(conn_server):
    sock = connect(conn_server)
    sock.sendall(
        b"GET /v2/health/live?" + b"a" * 64_000 + b" HTTP/1.1\r\nHost: t\r\n\r\n"
    )  # ~64 kB in one send
    data, _ = read_until_closed(sock)
    assert status_of(data) in (414, 431) and b'"error"' in data, data[:200]


def test_the_parsers_own_400_is_the_protocols_json_error(conn_server):
    sock = connect(conn_server)
    sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\nContent-Length: \xd9\xa1\r\n\r\n")
    data, _ = read_until_closed(sock)
    assert status_of(data) == 400 and b"application/json" in data.lower(), data[:300]
    assert set(json.loads(data.split(b"\r\n\r\n", 1)[1])) == {"error"}
