"""The model server: our own Open Inference Protocol server, with KServe's app beside it for the server-level routes.

KServe is the deployment target (an ``InferenceService`` runs our predictor container, ``serving.manifest``); the
protocol is served by our code. ``serving.gateway`` is the ASGI application uvicorn runs: it answers the ranker's
V1/V2 routes itself (limits, deadlines, strict parsing, both protocols' error shapes) and hands the server-level
routes (health, server metadata, the model list, ``/metrics``, the opt-in model-repository extension) to KServe's
FastAPI app. That app is built through KServe's public API only: a ``kserve.ModelServer`` holds the model registry
(``register_model``), a ``RESTServer`` registers KServe's routes on it (``create_application``); uvicorn's own
``Server`` then serves the gateway on ``cfg.host`` (KServe's servers bind ``0.0.0.0``) with the connection limits
of ``serving.connections``, on this process's own socket when several server processes share the port.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable

import kserve
import uvicorn
from kserve import model_server
from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
from kserve.protocol.rest.server import RESTServer

from gemflow.workspace import Workspace
from serving.auth import Tokens
from serving.config import ServingConfig
from serving.connections import set_access_log, uvicorn_settings

log = logging.getLogger(__name__)
GRACE_S = 30  # SIGTERM: requests in flight get this long to finish (KServe's default grace period)


def kserve_app(predictor: kserve.Model):
    """KServe's FastAPI app with its V1/V2 routes, serving ``predictor`` (loaded) from its model registry."""
    if not predictor.ready:
        raise RuntimeError(f"model {predictor.name!r} is not ready: nothing to serve")
    kserve_server = kserve.ModelServer(enable_grpc=False, workers=1, enable_latency_logging=False)
    kserve_server.register_model(predictor)
    RESTServer(FASTAPI_APP_IMPORT_STRING, kserve_server.dataplane, kserve_server.model_repository_extension,
               http_port=0).create_application()  # fmt: skip
    return model_server.app


def run_server(cfg: ServingConfig, app, sock: socket.socket | None = None) -> None:
    """Serve the ASGI ``app`` on ``cfg.host:cfg.http_port`` (or on ``sock``) until SIGTERM / SIGINT; uvicorn
    finishes the requests in flight first (``GRACE_S``)."""
    config = uvicorn.Config(app, host=cfg.host, port=cfg.http_port, log_config=None,
                            timeout_graceful_shutdown=GRACE_S, **uvicorn_settings(cfg.connections))  # fmt: skip
    set_access_log(cfg.connections.access_log)
    server = uvicorn.Server(config)
    # uvicorn raises the signal that stopped it again once it has shut down: this handler takes it, so that the
    # process ends as a finished server (exit code 0), not as one killed by it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    with asyncio.Runner(loop_factory=loop_factory(cfg.connections.event_loop)) as runner:
        runner.run(server.serve(sockets=None if sock is None else [sock]))


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``connections.event_loop`` names: uvloop's, or None for the standard library's."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def _log_to_stderr() -> None:
    """The ``serving`` and ``models`` loggers (the ranker's load: which GEMMs it scores with) print one line per
    event (KServe configures only its own loggers)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("serving", "models"):
        root = logging.getLogger(name)
        if not root.handlers:
            root.addHandler(handler)
            root.setLevel(logging.INFO)
            root.propagate = False


def serve(cfg: ServingConfig, ws: Workspace, listen: Callable[[], socket.socket] | None = None) -> None:
    """Load the ranker and block serving HTTP on ``cfg.host:cfg.http_port``, or, as one of several server
    processes, on the socket ``listen`` returns once the model is loaded; with ``cfg.server_processes`` > 1,
    supervise that many (``serving.server_processes``)."""
    _log_to_stderr()
    tokens = Tokens.from_env(cfg.admin.repository_api)  # refuse a bad auth setup before loading anything
    if cfg.server_processes > 1:
        from serving.server_processes import Supervisor

        return Supervisor(cfg, ws.root).run()
    from serving.gateway import Gateway
    from serving.pauses import freeze_heap
    from serving.predictor import RankerPredictor

    predictor = RankerPredictor(cfg, ws)
    predictor.load()
    frozen = freeze_heap()  # what loading left alive is never walked by a collection again (serving.pauses)
    predictor.pauses.clear_gc()  # /stats' GC pauses are serving's own, not loading's
    log.info("%d objects frozen out of garbage collection", frozen)
    sock = None if listen is None else listen()
    if tokens.inference is None:
        log.info("inference routes are open (set $GEMFLOW_SERVING_TOKEN to require a bearer token)")
    log.info("serving %s on http://%s:%d (%s event loop)", predictor.name, cfg.host, cfg.http_port,
             cfg.connections.event_loop)  # fmt: skip
    try:
        run_server(cfg, Gateway(kserve_app(predictor), predictor, cfg, tokens), sock)
    finally:
        predictor.stop()
