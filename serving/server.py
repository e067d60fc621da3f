"""The real KServe ``ModelServer`` around the ranker, safe by default.

KServe adds its V1/V2 routes to the module-level ``kserve.model_server.app`` when the server starts.
``serving.gateway`` wraps that app as the ASGI application uvicorn runs: it answers the ranker's routes itself,
before any of FastAPI's layers (middleware, routing), and hands the rest to KServe. ``ModelServer.start``
hard-codes ``0.0.0.0`` and uvicorn's defaults, so ``GemflowModelServer`` builds the same ``RESTServer`` with the
configured host, the gateway and the connection limits (``serving.connections``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import kserve
from kserve.constants.constants import FASTAPI_APP_IMPORT_STRING
from kserve.protocol.rest.server import RESTServer

from gemflow.workspace import Workspace
from serving.auth import Tokens
from serving.config import ServingConfig
from serving.connections import set_access_log, uvicorn_settings

log = logging.getLogger(__name__)


class GemflowModelServer(kserve.ModelServer):
    """``kserve.ModelServer`` whose REST server binds ``cfg.host``, runs ``app`` (the gateway around KServe's
    app) and applies ``cfg.connections``' limits."""

    def __init__(self, cfg: ServingConfig, app):
        super().__init__(http_port=cfg.http_port, enable_grpc=False, workers=1, enable_latency_logging=False)
        self.cfg, self.app = cfg, app

    def start(self, models, sock: socket.socket | None = None) -> None:
        """Serve ``models``, on ``sock`` when given (this process's own socket on a port several share)."""
        self._register_and_check_atleast_one_model_is_ready(models)
        rest = RESTServer(FASTAPI_APP_IMPORT_STRING, self.dataplane, self.model_repository_extension,
                          self.http_port, workers=1, grace_period=self.grace_period)  # fmt: skip
        rest.config.host = self.cfg.host
        rest.config.app = self.app  # an ASGI object instead of KServe's import string (one worker process)
        for key, value in uvicorn_settings(self.cfg.connections).items():
            setattr(rest.config, key, value)
        set_access_log(self.cfg.connections.access_log)
        self._rest_server = rest
        self.servers.append(rest.start() if sock is None else _serve_on(rest, sock))
        self.setup_event_loop()
        self.register_signal_handler()
        log.info("serving %s on http://%s:%d (%s event loop)", [m.name for m in models], self.cfg.host,
                 self.http_port, self.cfg.connections.event_loop)  # fmt: skip
        with asyncio.Runner(loop_factory=loop_factory(self.cfg.connections.event_loop)) as runner:
            runner.run(self._serve())


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``connections.event_loop`` names: uvloop's, or None for the standard library's."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


async def _serve_on(rest: RESTServer, sock: socket.socket) -> None:
    """``RESTServer.start`` on an already bound socket (its uvicorn server takes one; KServe does not pass it)."""
    rest.create_application()
    await rest._server.serve(sockets=[sock])


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
    from kserve import model_server

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
    GemflowModelServer(cfg, Gateway(model_server.app, predictor, cfg, tokens)).start([predictor], sock)
