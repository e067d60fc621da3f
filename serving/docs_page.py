"""``GET /docs``: what the ranker server answers, as one self-contained HTML page (no token, no script; KServe's
Swagger UI loads its scripts from a CDN)."""

from __future__ import annotations

import html


def docs_page(name: str, version: str, open_routes: dict[str, str]) -> bytes:
    """``GET /docs``: what this server answers, as one self-contained HTML page (no token, no script)."""
    rows = [
        ("POST", f"/v1/models/{name}:predict", "rank candidates (V1); bearer token"),
        ("POST", f"/v2/models/{name}/infer", "rank candidates (Open Inference Protocol); bearer token"),
        ("GET", f"/v2/models/{name}/ready", "model readiness (no token)"),
        ("GET", f"/v1/models/{name}", "model readiness, V1 (no token)"),
        ("GET", f"/v2/models/{name}", "model metadata: inputs, outputs, version; bearer token"),
        ("GET", f"/v2/models/{name}/stats", "request and latency statistics; bearer token"),
        *((("GET", p, f"server {label} (no token)") for p, label in open_routes.items())),
    ]
    table = "".join(
        f"<tr><td>{m}</td><td><code>{html.escape(p)}</code></td><td>{html.escape(d)}</td></tr>"
        for m, p, d in rows
    )
    example = html.escape(
        f'curl -H "Authorization: Bearer $TOKEN" -H "Content-Type: application/json" '
        f'-d \'{{"instances": [{{"user_id": 42, "candidates": [7, 8, 9]}}]}}\' '
        f"http://HOST:PORT/v1/models/{name}:predict"
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(name)} API</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 12px;text-align:left}"
        "tr:nth-child(even){background:#f3f3f3}code,pre{background:#eee;padding:2px 4px}</style></head><body>"
        f"<h1>{html.escape(name)} ranker endpoint</h1><p>Serving version <b>{html.escape(str(version))}</b> "
        "(KServe model server behind gemflow's gateway; every other path answers 404).</p>"
        f"<table><tr><th>method</th><th>path</th><th>what</th></tr>{table}</table>"
        f"<h2>Example</h2><pre>{example}</pre><p><code>gemflow rank --url http://HOST:PORT --user 42 "
        "--candidates 7,8,9</code> sends the same request.</p></body></html>"
    )
    return page.encode()
