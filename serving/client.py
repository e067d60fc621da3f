"""A small HTTP client of the ranker (``gemflow rank``, tests, the load bench): V1 and V2 bodies, one call."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def v1_body(
    user_id: int | str,
    candidates: list[int | str] | None,
    context: dict | None = None,
    retrieve: dict | None = None,
) -> dict:
    """``candidates`` None: the server retrieves them (``retrieve``: {"k", "exclude_advertisers"}, both optional)."""
    body: dict = {"user_id": user_id}
    if candidates is None:
        body["retrieve"] = retrieve or {}
    else:
        body["candidates"] = candidates
    if context:
        body["context"] = context
    return body


def v2_body(
    user_id: int | str,
    candidates: list[int | str] | None,
    context: dict | None = None,
    retrieve: dict | None = None,
) -> dict:
    """``candidates`` None: ``retrieve`` ({"k", "exclude_advertisers"}) travels as the retrieve_k and
    exclude_advertisers tensors (V2 has no default K: send k)."""

    def ids(values: list) -> str:  # the caller's text ids travel as BYTES
        return "INT64" if all(type(v) is int for v in values) else "BYTES"

    inputs = [{"name": "user_id", "shape": [1], "datatype": ids([user_id]), "data": [user_id]}]
    if candidates is not None:
        cands = candidates if ids(candidates) == "INT64" else [str(c) for c in candidates]
        inputs.append(
            {"name": "candidates", "shape": [len(candidates)], "datatype": ids(candidates), "data": cands}
        )
    retrieve = retrieve or {}
    if "k" in retrieve:
        inputs.append({"name": "retrieve_k", "shape": [1], "datatype": "INT64", "data": [retrieve["k"]]})
    if retrieve.get("exclude_advertisers"):
        excluded = list(retrieve["exclude_advertisers"])
        inputs.append(
            {"name": "exclude_advertisers", "shape": [len(excluded)], "datatype": "INT64", "data": excluded}
        )
    ctx = context or {}
    if "surface" in ctx:
        inputs.append({"name": "surface", "shape": [1], "datatype": "BYTES", "data": [ctx["surface"]]})
    if "hour" in ctx:
        inputs.append({"name": "hour", "shape": [1], "datatype": "INT64", "data": [ctx["hour"]]})
    if "request_ts" in ctx:
        inputs.append({"name": "request_ts", "shape": [1], "datatype": "FP64", "data": [ctx["request_ts"]]})
    return {"inputs": inputs}


def post(url: str, body: dict | bytes, timeout: float = 10.0) -> tuple[int, dict]:
    """POST JSON; returns (status, decoded body) for 2xx and 4xx/5xx alike."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        text = err.read()
        try:
            return err.code, json.loads(text or b"{}")
        except json.JSONDecodeError:
            return err.code, {"error": text.decode(errors="replace")}


def get(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def rank(
    base_url: str,
    model: str,
    user_id: int | str,
    candidates: list[int | str] | None,
    context: dict | None = None,
    protocol: str = "v1",
    retrieve: dict | None = None,
) -> tuple[int, dict]:
    """``candidates`` None: retrieve then rank (``retrieve``: {"k", "exclude_advertisers"})."""
    base = base_url.rstrip("/")
    if protocol == "v2":
        return post(f"{base}/v2/models/{model}/infer", v2_body(user_id, candidates, context, retrieve))
    return post(f"{base}/v1/models/{model}:predict", v1_body(user_id, candidates, context, retrieve))
