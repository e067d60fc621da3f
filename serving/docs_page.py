"""``GET /docs``: the endpoint's OpenAPI document (``serving.openapi``) as one self-contained HTML page (no token,
no script; KServe's Swagger UI loads its scripts from a CDN)."""

from __future__ import annotations

import html


def docs_page(doc: dict) -> bytes:
    """One row per operation of ``doc``, in its order; a link to the document itself."""
    name = doc["info"]["title"]
    rows = "".join(
        f"<tr><td>{method.upper()}</td><td><code>{html.escape(path)}</code></td>"
        f"<td>{html.escape(op['summary'])}{'; bearer token' if op.get('security') else ' (no token)'}</td></tr>"
        for path, operations in doc["paths"].items()
        for method, op in operations.items()
    )
    predict = next(
        p for p, ops in doc["paths"].items() if ops.get("post", {}).get("operationId") == "v1_predict"
    )
    example = html.escape(
        f'curl -H "Authorization: Bearer $TOKEN" -H "Content-Type: application/json" '
        f'-d \'{{"instances": [{{"user_id": "u_42", "candidates": [7, "SKU-8", 9]}}]}}\' http://HOST:PORT{predict}'
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(name)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:4px 12px;text-align:left}"
        "tr:nth-child(even){background:#f3f3f3}code,pre{background:#eee;padding:2px 4px}</style></head><body>"
        f"<h1>{html.escape(name)}</h1><p>Serving version <b>{html.escape(doc['info']['version'])}</b> "
        "(KServe model server behind gemflow's gateway; every other path answers 404). The OpenAPI document: "
        "<a href='/docs/openapi.json'><code>/docs/openapi.json</code></a>.</p>"
        f"<table><tr><th>method</th><th>path</th><th>what</th></tr>{rows}</table>"
        f"<h2>Example</h2><pre>{example}</pre><p><code>gemflow rank --url http://HOST:PORT --user u_42 "
        "--candidates 7,SKU-8,9</code> sends the same request.</p></body></html>"
    )
    return page.encode()
