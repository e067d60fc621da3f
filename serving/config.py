"""The serving config: one dataclass drives the local ``gemflow serve`` process and the cluster InferenceService.

Budgets are in milliseconds. ``feature_timeout_ms`` bounds the per-request online-store read (the user side);
past it the request is answered on the degraded path. ``request_timeout_ms`` is the deadline of the whole request:
past it the work is cancelled and the client gets 503. ``max_in_flight`` bounds the requests admitted at once;
beyond it a request is shed at once (503 + ``Retry-After``) instead of queueing past its deadline.

``context.request_ts`` must lie in ``[now - request_ts_max_age_days, now + request_ts_max_ahead_s]`` of the server
clock: replaying a recent request is allowed, an epoch-zero or overflowing timestamp is a client mistake.

Secrets are not config: the inference bearer token comes from ``GEMFLOW_SERVING_TOKEN`` and the model-repository
token from ``GEMFLOW_SERVING_ADMIN_TOKEN`` (``serving.auth``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from features.feature_repo import FeatureStoreConfig
from serving.retrieval.config import RetrievalConfig

MODEL_NAME = "gem-ranker"
EVENT_LOOPS = ("uvloop", "asyncio")  # ``connections.event_loop``


@dataclass
class LimitsConfig:
    max_candidates: int = 5000
    max_body_bytes: int = 1_000_000  # a 5,000-candidate request is ~40 kB of JSON
    feature_timeout_ms: float = (
        8.0  # user-side online read budget, floor (worker thread); past it -> degraded
    )
    feature_timeout_max_ms: float = 30.0  # its cap: the budget adapts to 1.5 x the reads' p99.9 in between
    request_timeout_ms: float = 2000.0  # whole request; past it -> 503 with a message
    # the body's own budget, from the end of the head: a request takes an admission slot only once its body has
    # arrived, and a client still sending after this is answered 408 and cut off (a 40 kB body takes ~1 ms on a LAN)
    body_timeout_ms: float = 1000.0
    max_context_keys: int = 16
    max_in_flight: int = 16  # admitted requests at once (parsing, reading, queued or scoring); beyond -> 503
    retry_after_s: int = 1  # the Retry-After of a shed request
    request_ts_max_age_days: float = 365.0  # oldest request_ts accepted (replays of recent traffic)
    request_ts_max_ahead_s: float = 3600.0  # newest request_ts accepted (clock skew between hosts)


@dataclass
class ConnectionConfig:
    """Connection-level limits of the HTTP server (uvicorn's h11 protocol, ``serving.connections``)."""

    header_timeout_s: float = 5.0  # from a request's first byte to its last header line (slow-loris guard)
    idle_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_header_bytes: int = 16 * 1024  # request line + all headers
    max_headers: int = 64  # header lines per request
    # open connections from one client address (per server process); beyond it a new one is answered 503 and
    # closed. Behind a proxy (Knative's queue-proxy) every connection comes from the proxy: 0 turns it off
    max_per_client: int = 128
    http_parser: str = "httptools"  # uvicorn's protocol: httptools (C) or h11 (pure Python); same limits
    # uvicorn's access log, one line per request: off by default (/metrics counts every response by route and
    # status, and a refused request logs its own line); at 250 requests/s it cost ~1.5% of the server's CPU
    access_log: bool = False
    # the server's asyncio event loop: uvloop (libuv, in C) or the standard library's (in Python). A request crosses
    # the loop twice (arrival, answer from its scoring thread): uvloop took 4% off the server's CPU per request
    # (docs/serving-speed.md, round 12)
    event_loop: str = "uvloop"


@dataclass
class AdminConfig:
    # KServe's model-repository extension (POST /v2/repository/models/{m}/load|unload): off unless enabled, and
    # then only with ``Authorization: Bearer $GEMFLOW_SERVING_ADMIN_TOKEN`` (the server refuses to start without it).
    repository_api: bool = False


@dataclass
class ScoringConfig:
    batch_size: int = 2048  # candidates scored per forward call (they share the user's K/V)
    torch_threads: int = 1  # intra-op threads per scoring worker (small matmuls: fork/join costs more)
    workers: int = 2  # requests scored at once, each on its own thread (about one per core)
    processes: int = (
        0  # > 0: score in this many worker processes instead (no shared GIL; serving.scoring_processes)
    )
    feature_workers: int = 4  # online-store read threads (a read holds one ~1 ms; a hung store, all)
    # reads that may wait for a busy worker; beyond that -> degraded at once. Waits as deep as admission (12) turned
    # feature_store_busy into timeouts under overload and cost CPU (docs/serving-speed.md, issue 35): 0
    feature_waiting: int = 0
    # a request that finds the server idle is read and scored on the event loop itself, no thread woken: 7-11% less
    # CPU per request at 100 req/s. Never while another request is in flight or right after one (a busy server
    # reads, admits and sheds as without it), and only where the read cannot wait: a local SQLite store, its lock
    # free, a locked file answering at once (serving.scoring_threads, UserFeatureReader.read_now)
    inline: bool = True
    gil_switch_ms: float = 1.0  # interpreter switch interval (serving.runtime); 0 = CPython's default, 5 ms
    cache_mb: float = 128.0  # memory for per-ad query rows, all surfaces (serving.candidate_cache); 0 = off
    torchscript: bool = (
        True  # score candidates through the TorchScript one-user path (models.inference.one_user)
    )


@dataclass
class AdTableConfig:
    refresh_seconds: float = 60.0  # background refresh period of the in-process ad table
    refresh_process: bool = True  # build each snapshot in a child process (serving.ad_table: the GIL)
    # this many failed refreshes in a row make the table too stale to serve: readiness turns false (0 = never)
    max_refresh_failures: int = 10
    lookup_chunk: int = 2000  # ads per Feast online read during a refresh
    feature_service: str = "ad_candidates"


@dataclass
class FeatureLogConfig:
    """Served-feature logging (``serving.feature_log``), read back by ``gemflow skew-check``."""

    sample_rate: float = 0.01  # fraction of answered requests whose user-side inputs are logged; 0 = off
    flush_rows: int = 1000  # rows per parquet file, at most
    flush_seconds: float = 30.0  # a partial buffer is written after this long

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"feature_log.sample_rate must be in [0, 1], got {self.sample_rate}")
        if self.flush_rows < 1 or self.flush_seconds <= 0:
            raise ValueError("feature_log.flush_rows must be >= 1 and feature_log.flush_seconds > 0")


@dataclass
class ClusterConfig:
    """What ``serving.manifest`` renders into the InferenceService (Knative mode, canary)."""

    namespace: str = "gemflow"
    image: str = "ghcr.io/gemflow/gemflow:0.1.0"
    service_account: str = ""
    canary_traffic_percent: int = 10  # share of traffic sent to the newest revision (Knative only)
    min_replicas: int = 1
    max_replicas: int = 4
    cpu_request: str = "2"
    cpu_limit: str = "2"
    memory_request: str = "2Gi"
    memory_limit: str = "4Gi"
    mlflow_tracking_uri: str = "http://mlflow.gemflow.svc.cluster.local:5000"
    redis_connection: str = "redis.gemflow.svc.cluster.local:6379"


@dataclass
class ServingConfig:
    model_name: str = MODEL_NAME
    model_uri: str = f"models:/{MODEL_NAME}@champion"
    tracking_uri: str = (
        ""  # "" = $MLFLOW_TRACKING_URI, else the workspace's store (models.tracking.mlflow_store)
    )
    # The user-model version the cached embeddings must come from; "" = the one the ranker was trained against.
    expected_user_model_version: str = ""
    host: str = "127.0.0.1"  # loopback by default; the chart binds 0.0.0.0 inside the pod
    http_port: int = 8080
    # > 1: this many whole server processes share the port, each with its own event loop, store reads and scoring
    # (no GIL shared by concurrent requests; serving.server_processes). Limits apply per process.
    server_processes: int = 1
    feature_store: FeatureStoreConfig = field(default_factory=FeatureStoreConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    connections: ConnectionConfig = field(default_factory=ConnectionConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    ad_table: AdTableConfig = field(default_factory=AdTableConfig)
    feature_log: FeatureLogConfig = field(default_factory=FeatureLogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)  # requests without candidates

    def __post_init__(self) -> None:
        lim = self.limits
        if lim.max_candidates < 1:
            raise ValueError(f"limits.max_candidates must be >= 1, got {lim.max_candidates}")
        if lim.max_body_bytes < 1024:
            raise ValueError(f"limits.max_body_bytes must be >= 1024, got {lim.max_body_bytes}")
        if (
            min(lim.feature_timeout_ms, lim.request_timeout_ms, lim.body_timeout_ms) <= 0
            or lim.feature_timeout_max_ms < 0
        ):
            raise ValueError("limits.feature_timeout_ms, request_timeout_ms and body_timeout_ms must be > 0")
        if lim.max_in_flight < 1 or lim.retry_after_s < 0:
            raise ValueError("limits.max_in_flight must be >= 1 and limits.retry_after_s >= 0")
        if lim.request_ts_max_age_days <= 0 or lim.request_ts_max_ahead_s < 0:
            raise ValueError(
                "limits.request_ts_max_age_days must be > 0 and limits.request_ts_max_ahead_s >= 0"
            )
        con = self.connections
        if (
            min(con.header_timeout_s, con.idle_timeout_s) <= 0
            or con.max_header_bytes < 1024
            or con.max_headers < 8
        ):
            raise ValueError(
                "connections: timeouts must be > 0, max_header_bytes >= 1024 and max_headers >= 8"
            )
        if con.max_per_client < 0:
            raise ValueError(
                f"connections.max_per_client must be >= 0 (0 = no limit), got {con.max_per_client}"
            )
        if con.http_parser not in ("httptools", "h11"):
            raise ValueError(f"connections.http_parser must be httptools or h11, got {con.http_parser!r}")
        if con.event_loop not in EVENT_LOOPS:
            raise ValueError(f"connections.event_loop must be uvloop or asyncio, got {con.event_loop!r}")
        sc = self.scoring
        if sc.cache_mb < 0:
            raise ValueError(f"scoring.cache_mb must be >= 0 (0 = no cache), got {sc.cache_mb}")
        if sc.feature_waiting < 0:
            raise ValueError(f"scoring.feature_waiting must be >= 0, got {sc.feature_waiting}")
        if sc.gil_switch_ms < 0:
            raise ValueError(
                f"scoring.gil_switch_ms must be >= 0 (0 = the interpreter's default), got {sc.gil_switch_ms}"
            )
        if self.ad_table.max_refresh_failures < 0:
            raise ValueError(
                f"ad_table.max_refresh_failures must be >= 0, got {self.ad_table.max_refresh_failures}"
            )
        if self.server_processes < 1:
            raise ValueError(f"server_processes must be >= 1, got {self.server_processes}")
        if self.server_processes > 1 and sc.processes > 0:
            raise ValueError("server_processes > 1 and scoring.processes > 0 do not combine: choose one")
        if sc.processes < 0:
            raise ValueError(f"scoring.processes must be >= 0 (0 = scoring threads), got {sc.processes}")
        if min(sc.batch_size, sc.feature_workers, sc.workers, sc.torch_threads) < 1:
            raise ValueError(
                "scoring.batch_size, scoring.feature_workers, scoring.workers and scoring.torch_threads must be >= 1"
            )
        self.retrieval.validate()
        if not 0 <= self.cluster.canary_traffic_percent <= 100:
            raise ValueError(
                f"cluster.canary_traffic_percent must be in 0..100, got {self.cluster.canary_traffic_percent}"
            )
