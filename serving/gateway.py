"""The ASGI layer in front of KServe's app: every request of the serving process passes here first.

It answers the ranker's own routes itself and hands a few to KServe (server health and metadata, ``/metrics``):
- ``POST /v1/models/{m}:predict`` and ``POST /v2/models/{m}/infer``: bearer token (``serving.auth``), explicit
  Content-Type / Content-Encoding rules, the body limit (413, connection closed) and the body's own time budget
  (``limits.body_timeout_ms``: 408, connection closed), then admission control (``limits.max_in_flight``; beyond
  it 503 + ``Retry-After`` at once): a slot is taken only once the whole body has arrived, so clients trickling
  their bodies hold connections (bounded per client address, ``serving.connections``), never the slots that
  scoring needs. Then strict parsing (``serving.schema`` / ``serving.v2``), the deadline (from the head's arrival;
  work cancelled, 503), and the answer's encoding;
- ``GET /v2/models/{m}/ready`` and ``GET /v1/models/{m}`` (readiness), ``GET /v2/models/{m}`` (Open Inference
  Protocol metadata), ``GET /v2/models/{m}/stats``;
- KServe's model-repository extension (``/v2/repository/...``) is answered 404 unless ``admin.repository_api``
  is on, and then needs the admin token; KServe's routes not listed in ``_OPEN_ROUTES`` are answered 404.
Every client mistake is a 4xx ``{"error": "..."}`` (both protocols) logged as one line; an unexpected failure is
a 500 that names no exception (the traceback goes to the log). Every response is counted by route and status.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time

import orjson

from serving import openapi, stats, v2
from serving.auth import Tokens, bearer_ok
from serving.config import ServingConfig
from serving.docs_page import docs_page
from serving.predictor import RankerPredictor
from serving.request_checks import content_problem, header_problem
from serving.request_scorer import Cancelled
from serving.retrieval.index import IndexVersionMismatch
from serving.retrieval.service import RetrievalUnavailable
from serving.schema import RequestError, parse_request
from serving.scoring_processes import WorkerLost

log = logging.getLogger(__name__)
JSON = (b"content-type", b"application/json")
NUMPY = orjson.OPT_SERIALIZE_NUMPY
CLOSE = (b"connection", b"close")
_MODEL_ROUTES = [  # (method, pattern, route label); the model name is the first group
    ("POST", re.compile(r"/v1/models/([^/:]+):predict"), "v1_predict"),
    ("POST", re.compile(r"/v2/models/([^/]+)/infer"), "v2_infer"),
    ("GET", re.compile(r"/v2/models/([^/]+)/ready"), "ready"),
    ("GET", re.compile(r"/v1/models/([^/:]+)"), "ready"),
    ("GET", re.compile(r"/v2/models/([^/]+)/stats"), "stats"),
    ("GET", re.compile(r"/v2/models/([^/]+)"), "metadata"),
]
_VERSIONED = re.compile(r"/v2/models/[^/]+/versions/.*")
# KServe's own routes that stay reachable (no token: probes, Prometheus, server metadata); anything else is 404
_OPEN_ROUTES = {"/v2/health/live": "live", "/v2/health/ready": "live", "/": "live", "/metrics": "metrics",
                "/v2": "metadata", "/v2/models": "metadata", "/v1/models": "metadata"}  # fmt: skip
# what /docs says each open route is (the readiness probe is counted with the liveness probes above)
_DOC_LABELS = {**_OPEN_ROUTES, "/v2/health/ready": "server_ready", "/v2": "server_metadata",
               "/v2/models": "server_metadata", "/v1/models": "server_metadata"}  # fmt: skip


class Reply:
    """The response side of one request: how to send it, and its count by route and status, taken as the response
    starts (before the client can read it: a client that reads the statistics next finds its answer counted)."""

    def __init__(self, send, count):
        self.send, self.count = send, count
        self.status: int | None = None
        self.route = "other"  # the dispatcher names it before answering

    def start(self, status: int) -> None:
        self.status = status
        self.count(self.route, status)

    async def body(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.start(status)
        head = [(b"content-length", str(len(body)).encode()), *headers]
        await self.send({"type": "http.response.start", "status": status, "headers": head})
        await self.send({"type": "http.response.body", "body": body})

    async def json(self, status: int, payload: dict, *extra: tuple[bytes, bytes]) -> None:
        await self.body(status, orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY), [JSON, *extra])


class Gateway:
    def __init__(self, app, predictor: RankerPredictor, cfg: ServingConfig, tokens: Tokens):
        self.app, self.predictor, self.cfg, self.tokens = app, predictor, cfg, tokens
        self.in_flight = 0  # admitted inference requests not answered yet (one event loop: no lock)
        rc = cfg.retrieval
        self._retrieve_k = (
            (rc.index.default_k, rc.index.max_k) if rc.enabled else None
        )  # None: never retrieves

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        reply = Reply(send, self.predictor.stats.response)
        try:
            await self._dispatch(scope, receive, reply)
        except Exception:
            # a bug, not a client mistake: the traceback is logged, the client learns nothing of it
            log.exception("unexpected failure on %s %s", scope["method"], _loggable(scope["path"][:200]))
            if reply.status is None:
                await reply.json(500, {"error": "internal server error"})
        finally:
            if reply.status is None:
                reply.start(499)  # the client went away unanswered

    # ------------------------------------------------------------------------------------------- routing
    async def _dispatch(self, scope, receive, reply: Reply) -> None:
        method, path = scope["method"], scope["path"]
        too_many = header_problem(scope, self.cfg.connections)
        if too_many:
            return await self._refuse(reply, scope, *too_many, CLOSE)
        if path == "/metrics" and method == "GET" and stats.multiprocess():  # every server process's metrics
            reply.route = "metrics"
            body, content_type = stats.exposition()
            return await reply.body(200, body, [(b"content-type", content_type.encode())])
        if path in _OPEN_ROUTES:
            reply.route = _OPEN_ROUTES[path]
            return await self._pass(scope, receive, reply)
        if path in ("/docs", "/docs/openapi.json") and method == "GET":  # KServe's Swagger UI needs a CDN
            reply.route = "docs"
            served = self.predictor.served.version
            doc = openapi.document(self.predictor.name, served, _MODEL_ROUTES, _DOC_LABELS)
            if path == "/docs":
                return await reply.body(200, docs_page(doc), [(b"content-type", b"text/html; charset=utf-8")])
            return await reply.json(200, doc)
        if path.startswith("/v2/repository"):
            reply.route = "repository"
            return await self._repository(scope, receive, reply)
        if _VERSIONED.fullmatch(path):
            return await self._refuse(
                reply, scope, 404, "model versions are not addressable; use /v2/models/{name}/..."
            )
        for want, pattern, route in _MODEL_ROUTES:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            reply.route = route
            if method != want:
                return await self._refuse(
                    reply, scope, 405, f"{path} takes {want}", (b"allow", want.encode())
                )
            if match.group(1) != self.predictor.name:
                return await self._refuse(
                    reply, scope, 404, f"model {match.group(1)[:80]!r} is not served here"
                )
            return await self._model_route(route, scope, receive, reply)
        # default deny: KServe's other routes (explain, versioned paths, docs) are not part of this server
        await self._refuse(reply, scope, 404, f"no route {method} {path[:100]}")

    async def _model_route(self, route: str, scope, receive, reply: Reply) -> None:
        if route == "ready":  # probes carry no token
            ok, detail = await self.predictor.readiness()
            return await reply.json(200 if ok else 503, detail)
        headers = dict(scope["headers"])
        if not bearer_ok(headers, self.tokens.inference):
            return await self._refuse(reply, scope, 401, "a valid bearer token is required",
                                      (b"www-authenticate", b"Bearer"))  # fmt: skip
        if route == "metadata":
            return await reply.json(200, v2.metadata(self.predictor.name, self.predictor.served.version))
        if route == "stats":
            _, detail = await self.predictor.readiness()
            p = self.predictor
            # the protocol's statistics extension shape, then ours
            protocol = p.stats.model_stats(p.name, p.served.version)
            ours = {"stats": p.stats.snapshot(), "pauses": p.pauses.snapshot(), "pid": os.getpid(),
                    "inline_answers": p.inline_answers()}  # fmt: skip
            return await reply.json(200, {**protocol, **detail, **ours})
        if not self.predictor.ready:  # unloaded through the (token-guarded) repository extension
            return await reply.json(503, {"error": f"model {self.predictor.name!r} is not loaded"})
        await self._infer(route == "v2_infer", scope, headers, receive, reply)

    async def _repository(self, scope, receive, reply: Reply) -> None:
        if self.tokens.admin is None:
            return await self._refuse(reply, scope, 404, "the model-repository extension is disabled")
        if not bearer_ok(dict(scope["headers"]), self.tokens.admin):
            return await self._refuse(reply, scope, 401, "the admin bearer token is required",
                                      (b"www-authenticate", b"Bearer"))  # fmt: skip
        await self._pass(scope, receive, reply)

    async def _pass(self, scope, receive, reply: Reply) -> None:
        """KServe's own handling, its answers in this server's shape: a 500 without its exception text, any other
        error as ``{"error": ...}`` (FastAPI answers ``{"detail": ...}``), and the server metadata (``/v2``)
        without the model-repository extension while that is disabled."""
        held: dict = {}  # an answer rewritten before it goes out: its start message, then its body parts

        async def guarded(message):
            if held.get("done"):
                return
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 500:
                    held["done"] = True
                    return await reply.json(500, {"error": "internal server error"})
                if status >= 400 or scope["path"] == "/v2":
                    held.update(start=message, body=[])
                    return
                reply.start(status)
                return await reply.send(message)
            if "start" not in held:
                return await reply.send(message)
            held["body"].append(message.get("body", b""))
            if not message.get("more_body", False):
                held["done"] = True
                await self._rewritten(held["start"], b"".join(held["body"]), reply)

        await self.app(scope, receive, guarded)

    async def _rewritten(self, start: dict, body: bytes, reply: Reply) -> None:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            payload = {"error": body[:300].decode("utf-8", "replace")}
        if isinstance(payload, dict) and "detail" in payload and "error" not in payload:
            detail = payload["detail"]
            payload = {"error": detail if isinstance(detail, str) else orjson.dumps(detail).decode()[:300]}
        if (
            isinstance(payload, dict)
            and isinstance(payload.get("extensions"), list)
            and self.tokens.admin is None
        ):
            payload["extensions"] = [e for e in payload["extensions"] if e != "model_repository_extension"]
        keep = [
            (k, v)
            for k, v in start.get("headers", [])
            if k.lower() not in (b"content-length", b"content-type")
        ]
        await reply.json(start["status"], payload, *keep)

    async def _refuse(self, reply: Reply, scope, status: int, message: str, *headers) -> None:
        """A client mistake: one log line, the protocol's error shape."""
        log.info(
            "%d %s %s: %s", status, scope["method"], _loggable(scope["path"][:200]), _loggable(message[:300])
        )
        await reply.json(status, {"error": message}, *headers)

    # ------------------------------------------------------------------------------------------- inference
    async def _infer(self, is_v2: bool, scope, headers: dict, receive, reply: Reply) -> None:
        problem = content_problem(is_v2, headers)
        if problem:
            return await self._refuse(reply, scope, 415, problem)
        lim = self.cfg.limits
        deadline = time.monotonic() + lim.request_timeout_ms / 1e3
        # the body first, on its own short budget: a client trickling it holds its connection, never a slot
        try:  # (asyncio.timeout, not wait_for: no Task created per await)
            async with asyncio.timeout(lim.body_timeout_ms / 1e3):
                raw = await self._read_body(scope, headers, receive, reply)
        except TimeoutError:
            if reply.status is not None:  # the read had already answered (413) when the budget ran out
                return
            self.predictor.stats.shed_one("body_timeout")
            return await self._refuse(
                reply, scope, 408, f"the body did not arrive within {lim.body_timeout_ms:.0f} ms", CLOSE
            )
        if raw is None:
            return
        if self.in_flight >= lim.max_in_flight:  # shed before parsing anything
            self.predictor.stats.shed_one("in_flight_limit")
            return await reply.json(503, {"error": f"overloaded: {lim.max_in_flight} requests in flight"},
                                    (b"retry-after", str(lim.retry_after_s).encode()))  # fmt: skip
        self.in_flight += 1
        try:
            await self._admitted(is_v2, scope, headers, raw, deadline, reply)
        finally:
            self.in_flight -= 1

    async def _admitted(
        self, is_v2: bool, scope, headers: dict, raw: bytes, deadline: float, reply: Reply
    ) -> None:
        lim = self.cfg.limits
        now, t_parse = time.time(), time.perf_counter()
        bounds = (now - 86400 * lim.request_ts_max_age_days, now + lim.request_ts_max_ahead_s)
        try:
            if is_v2:
                v2req = v2.decode(
                    raw,
                    v2.header_length(headers.get(b"inference-header-content-length"), len(raw)),
                    self.predictor.name,
                )
                body = v2req.body
            else:
                body = _json(raw)
            req = parse_request(body, lim.max_candidates, bounds, self._retrieve_k)
        except RequestError as err:
            self.predictor.stats.request("rejected")
            return await self._refuse(reply, scope, 400, str(err))
        parse_ms = 1e3 * (time.perf_counter() - t_parse)
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                result = await self.predictor.answer(req, deadline)
        except (TimeoutError, Cancelled):
            self.predictor.stats.shed_one("deadline")
            log.info(
                "503 %s: deadline of %.0f ms passed, work cancelled",
                _loggable(scope["path"][:200]),
                lim.request_timeout_ms,
            )
            return await reply.json(503, {"error": f"the request did not finish within {lim.request_timeout_ms:.0f} ms"},
                                    (b"retry-after", str(lim.retry_after_s).encode()))  # fmt: skip
        except RequestError as err:  # found while answering (retrieval: no eligible ad, or not offered)
            self.predictor.stats.request("rejected")
            return await self._refuse(reply, scope, 400, str(err))
        except (RetrievalUnavailable, IndexVersionMismatch) as err:  # no index yet, or one of another version
            self.predictor.stats.shed_one("retrieval_unavailable")
            log.warning("503 %s: %s", _loggable(scope["path"][:200]), err)
            return await reply.json(503, {"error": f"retrieval unavailable: {err}"},
                                    (b"retry-after", str(lim.retry_after_s).encode()))  # fmt: skip
        except WorkerLost as err:  # a scoring worker process died mid-request; a replacement is starting
            self.predictor.stats.shed_one("scoring_worker_lost")
            log.warning("503 %s: %s", _loggable(scope["path"][:200]), err)
            return await reply.json(503, {"error": "the scoring worker failed; retry"},
                                    (b"retry-after", str(lim.retry_after_s).encode()))  # fmt: skip
        t_encode = time.perf_counter()
        if is_v2:
            arrays = {k: result[k] for k in v2.OUTPUTS}
            body, extra = v2.encode(v2req, self.predictor.name, result["model_version"], result["request_id"], arrays,
                                    _v2_parameters(result))  # fmt: skip
        else:
            body, extra = (
                orjson.dumps({"predictions": [result]} if req.wrapped else result, option=NUMPY),
                [JSON],
            )
        encode_ms = 1e3 * (time.perf_counter() - t_encode)
        timing = result["timing_ms"]
        queue_ms = timing["total"] - timing["features"] - timing["build"] - timing["score"]
        # counted before the answer goes out: a client that reads the statistics next finds it there
        self.predictor.stats.phases(parse=parse_ms, features=timing["features"], queue=queue_ms, build=timing["build"],
                                    score=timing["score"], encode=encode_ms, total=parse_ms + timing["total"] + encode_ms)  # fmt: skip
        self.predictor.count(result)
        await reply.body(200, body, extra)

    async def _read_body(self, scope, headers: dict, receive, reply: Reply) -> bytes | None:
        """The whole body within ``limits.max_body_bytes``; None when already answered (413/400) or gone."""
        limit = self.cfg.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await self._refuse(reply, scope, 400, f"invalid Content-Length {declared[:20].decode('latin-1')!r}",
                                   CLOSE)  # fmt: skip
                return None
            if int(declared) > limit:
                await self._refuse(
                    reply, scope, 413, f"request body exceeds the limit of {limit} bytes", CLOSE
                )
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:  # a chunked body: stop reading, answer, close the connection
                await self._refuse(
                    reply, scope, 413, f"request body exceeds the limit of {limit} bytes", CLOSE
                )
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _loggable(text: str) -> str:
    """A client's text as one log line: control characters (a decoded ``%0a``) and non-ASCII escaped, so no client
    can forge or split a line of the server's log."""
    return text if text.isascii() and text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _json(raw: bytes):
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise RequestError(f"the body is not valid JSON: {err}") from None


def _v2_parameters(r: dict) -> dict:
    fb = r["fallback"]
    return {
        "user_id": r["user_id"],
        "model_version": r["model_version"],
        "expected_user_model_version": r["expected_user_model_version"] or "",
        "embedding_version": r["embedding_version"] or "",
        "ad_table_as_of": r["ad_table_as_of"] or "",
        **{f"fallback.{k}": (",".join(v) if isinstance(v, list) else v) for k, v in fb.items()},
        **{f"timing_ms.{k}": v for k, v in r["timing_ms"].items()},
        **{f"retrieval.{k}": "" if v is None else v for k, v in r.get("retrieval", {}).items()},
    }
