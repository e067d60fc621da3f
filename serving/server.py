"""The real KServe ``ModelServer`` with the ranker's limits and readiness in front of KServe's routes.

KServe adds its V1/V2 routes to the module-level ``kserve.model_server.app`` when the server starts; what is
added here first takes precedence:
- ``BodyLimit``: bodies over ``max_body_bytes`` -> 413 before anything is parsed (KServe has no REST limit);
- ``RequestDeadline``: a request still running after ``request_timeout_ms`` -> 503 with a message;
- model readiness (``GET /v2/models/{name}/ready``, ``GET /v1/models/{name}``) that covers the feature store
  and the ad table, not just "the model object is loaded" (predict keeps answering, degraded, meanwhile);
- ``GET /v2/models/{name}/stats``: fallback / mismatch counters and the process's pauses as JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging

from gemflow.workspace import Workspace
from serving.config import ServingConfig


def _json(status: int, payload: dict) -> tuple[dict, list[dict]]:
    body = json.dumps(payload).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }
    return start, [{"type": "http.response.body", "body": body}]


async def _send_json(send, status: int, payload: dict) -> None:
    start, bodies = _json(status, payload)
    await send(start)
    for b in bodies:
        await send(b)


class BodyLimit:
    """Reject request bodies larger than ``limit`` bytes (declared or streamed) with 413."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = f"request body exceeds the limit of {self.limit} bytes"
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await _send_json(send, 400, {"error": f"invalid Content-Length {declared.decode()!r}"})
            if size > self.limit:
                return await _send_json(send, 413, {"error": f"{too_big} (Content-Length: {size})"})
        seen = 0
        started = False

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _send_json(send, 413, {"error": too_big})


class _TooLarge(Exception):
    pass


class RequestDeadline:
    """Answer 503 when a request has not finished within ``seconds`` (a last-resort guard, never a hang)."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await asyncio.wait_for(self.app(scope, receive, tracking_send), self.seconds)
        except TimeoutError:
            if not started:
                await _send_json(
                    send, 503, {"error": f"request exceeded the {1e3 * self.seconds:.0f} ms deadline"}
                )


def install(app, predictor, cfg: ServingConfig) -> None:
    """Add the limits and the ranker's routes to KServe's FastAPI app (before KServe adds its own)."""
    from fastapi.responses import ORJSONResponse

    name = cfg.model_name

    async def ready():
        ok, detail = await predictor.readiness()
        return ORJSONResponse(detail, status_code=200 if ok else 503)

    async def stats():
        _, detail = await predictor.readiness()
        return ORJSONResponse(
            {**detail, "stats": predictor.stats.snapshot(), "pauses": predictor.pauses.snapshot()}
        )

    app.add_api_route(f"/v2/models/{name}/ready", ready, methods=["GET"])
    app.add_api_route(f"/v1/models/{name}", ready, methods=["GET"])
    app.add_api_route(f"/v2/models/{name}/stats", stats, methods=["GET"])
    # Starlette runs the last-added middleware first: the size check sees the raw request before the deadline.
    app.add_middleware(RequestDeadline, seconds=cfg.limits.request_timeout_ms / 1e3)
    app.add_middleware(BodyLimit, limit=cfg.limits.max_body_bytes)


def serve(cfg: ServingConfig, ws: Workspace) -> None:
    """Load the ranker and block serving HTTP on ``cfg.http_port`` (all interfaces: it runs in a pod)."""
    import kserve
    from kserve import model_server

    from serving.pauses import freeze_heap
    from serving.predictor import RankerPredictor

    predictor = RankerPredictor(cfg, ws)
    predictor.load()
    frozen = freeze_heap()  # what loading left alive is never walked by a collection again (serving.pauses)
    logging.getLogger(__name__).info("%d objects frozen out of garbage collection", frozen)
    install(model_server.app, predictor, cfg)
    server = kserve.ModelServer(
        http_port=cfg.http_port, enable_grpc=False, workers=1, enable_latency_logging=False
    )
    server.start([predictor])
