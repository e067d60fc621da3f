"""The checks on a request's head and on its body's declared content, before any of the body is read.

Both name the problem in words the client can act on; the gateway turns them into 4xx answers."""

from __future__ import annotations

from serving.config import ConnectionConfig


def header_problem(scope, con: ConnectionConfig) -> tuple[int, str] | None:
    """``serving.connections`` bounds a head that arrives in pieces; one that arrives whole in one read is bounded
    here, request line included (431, or 414 for the target alone; then closed)."""
    headers = scope["headers"]
    if len(headers) > con.max_headers:
        return 431, f"more than {con.max_headers} header lines"
    target = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    if target > con.max_header_bytes:
        return 414, f"the request target exceeds {con.max_header_bytes} bytes"
    if target + sum(len(k) + len(v) + 4 for k, v in headers) > con.max_header_bytes:
        return 431, f"the request head exceeds {con.max_header_bytes} bytes"
    return None


def content_problem(is_v2: bool, headers: dict) -> str | None:
    """Content-Encoding must be identity; V1 bodies are JSON; V2 bodies are JSON, or the binary extension when
    ``Inference-Header-Content-Length`` is set. A V2 body without Content-Type is JSON (tritonclient sends none)."""
    encoding = headers.get(b"content-encoding", b"identity").strip().lower()
    if encoding not in (b"", b"identity"):
        return f"Content-Encoding {encoding[:30].decode('latin-1')!r} is not supported: send the body uncompressed"
    ctype = headers.get(b"content-type")
    mime = None if ctype is None else ctype.split(b";", 1)[0].strip().lower()
    if not is_v2:
        if mime != b"application/json":
            return "the body must be JSON with Content-Type: application/json"
        return None
    allowed = (None, b"application/json")
    if b"inference-header-content-length" in headers:
        allowed = (None, b"application/json", b"application/octet-stream")
    if mime not in allowed:
        return f"Content-Type {ctype[:60].decode('latin-1')!r} is not accepted: JSON, or the binary extension"
    return None
