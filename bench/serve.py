"""Load bench of the online ranker: drives a running ``gemflow serve`` on 127.0.0.1 and prints figures.

    1. latency p50/p95/p99 and throughput for 100, 1,000 and 5,000 candidates: ``--concurrency`` closed-loop
       keep-alive clients, plus the server's CPU time per request (its process, from /proc) and the server's own
       breakdown of a request (parse, feature read, queue, tensor build, scoring, encode: mean wall ms);
    2. in process, side by side on the served model and the same inputs: the shared-K/V path (user side once,
       ``serving.scorer.score_shared``) against recomputing the user side for every candidate, both as a naive
       server would (one ``user_side`` + ``score`` call per candidate) and batched (the training-style forward
       over N (user, candidate) rows, ``score_recompute``);
       the shared path is the TorchScript one-user path the server runs (``models.inference.one_user``);
       ``--compile`` adds the shared-K/V scorer three ways: eager, ``Ranker.score`` compiled by inductor, and
       TorchScript (CPU ms per request; inductor measured earlier on a random-weight ranker of the bench world's
       shape, 2-core AMD EPYC under load: 0.68x at 100 candidates, 1.10x at 1,000, 1.13x at 5,000, and every new
       candidate-count range recompiles for ~50-100 s: not adopted in the server);
    3. a soak (``--soak SECONDS --rate R``): an open loop at R requests/s, then status counts (the client's and
       the server's, which must add up to what was sent; shed requests are 503s), latency of the admitted
       requests, degraded answers, server CPU per request, and the server's RSS at start / end / peak.

The bench world's users 0, 1 and 3 take the normal path (an embedding of the current user-model version); users
2 (an older version) and 4 (no embedding) are cold starts, sampled only with ``--cold-start``.

Usage (a bench world: 6,000 ads, the default ranker at d_model 64, 64 recent events, its own server):
    .venv/bin/python bench/serve.py --build-world /tmp/gemflow-bench
    .venv/bin/python bench/serve.py --build-world /tmp/gemflow-bench --only soak --soak 60 --rate 100
or against a server you started (``gemflow serve``): ``--url http://127.0.0.1:8080 --model-uri PATH --pid PID``.

The client shares the machine with the server: it is kept lean (``http.client`` keep-alive connections and
orjson) and its own CPU time per request is printed next to the server's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
import psutil
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from report import add_record_flag, record  # noqa: E402

MODEL = "gem-ranker"
PREDICT = f"/v1/models/{MODEL}:predict"
PHASES = ("latency", "compare", "soak")
FIGURES: list[tuple[str, str]] = []  # headline figures for --record (docs/benchmarks.md)


# ----------------------------------------------------------------------------------------------- client
class Client:
    """One keep-alive HTTP/1.1 connection (one per client thread)."""

    def __init__(self, base: str, timeout: float = 30.0):
        url = urllib.parse.urlparse(base)
        self.host, self.port, self.timeout = url.hostname, url.port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        for attempt in (0, 1):  # a keep-alive connection the server closed meanwhile is reopened once
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                return resp.status, resp.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def get_json(base: str, path: str) -> tuple[int, dict]:
    url = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, orjson.loads(resp.read() or b"{}")
    finally:
        conn.close()


def request_body(rng, users: list[int], num_ads: int, n: int, request_ts: float) -> bytes:
    cands = rng.choice(num_ads, size=n, replace=False).tolist()
    body = {"user_id": int(rng.choice(users)), "candidates": cands, "context": {"request_ts": request_ts}}
    return orjson.dumps(body)


@dataclass
class Tally:
    """What a phase observed, filled by many client threads."""

    client_ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)  # the server's own ``timing_ms.total``
    codes: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, took_ms: float, status: int | str, payload: bytes | None) -> None:
        reply = orjson.loads(payload) if status == 200 and payload else None
        with self.lock:
            self.codes[status] += 1
            if reply is None:
                return
            self.client_ms.append(took_ms)
            self.server_ms.append(reply["timing_ms"]["total"])
            for reason in reply["fallback"]["reasons"]:
                self.fallbacks[reason.split(":", 1)[0]] += 1

    @property
    def server_errors(self) -> int:
        return sum(v for k, v in self.codes.items() if not (isinstance(k, int) and k < 500))


def percentiles(ms: list[float]) -> str:
    if not ms:
        return "no successful requests"
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return f"p50 {p50:7.2f}  p95 {p95:7.2f}  p99 {p99:7.2f} ms"


def cpu_seconds(proc: psutil.Process | None) -> float:
    """CPU seconds of the server process and all its child processes, live (scoring worker processes, the ad-table
    refresh process) or ended."""
    if proc is None:
        return float("nan")
    t = proc.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in proc.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += c.user + c.system
    return total


# ------------------------------------------------------------------------------------------ 1. latency
def closed_loop(base: str, bodies: list[bytes], concurrency: int) -> tuple[Tally, float]:
    """``concurrency`` clients, each sending its share of ``bodies`` back to back; returns the tally, wall s."""
    tally = Tally()

    def worker(chunk: list[bytes]) -> None:
        client = Client(base)
        try:
            for body in chunk:
                t0 = time.perf_counter()
                try:
                    status, payload = client.post(PREDICT, body)
                except OSError as err:
                    status, payload = type(err).__name__, None
                tally.record(1e3 * (time.perf_counter() - t0), status, payload)
        finally:
            client.close()

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(worker, [bodies[i::concurrency] for i in range(concurrency)]))
    return tally, time.perf_counter() - t0


def run_latency(base, rng, users, num_ads, sizes, requests, concurrency, proc, request_ts) -> None:
    print(
        f"\n== latency over HTTP: {concurrency} concurrent keep-alive clients, {requests} requests per size"
    )
    print("   (server CPU = the server process's CPU seconds / request; client CPU = this bench's)")
    for n in sizes:
        bodies = [request_body(rng, users, num_ads, n, request_ts) for _ in range(requests)]
        closed_loop(base, bodies[: max(20, concurrency * 4)], concurrency)  # warm-up
        before = get_json(base, f"/v2/models/{MODEL}/stats")[1]["stats"]
        cpu0, me0 = cpu_seconds(proc), time.process_time()
        tally, wall = closed_loop(base, bodies, concurrency)
        server_cpu = 1e3 * (cpu_seconds(proc) - cpu0) / requests
        after = get_json(base, f"/v2/models/{MODEL}/stats")[1]["stats"]
        client_cpu = 1e3 * (time.process_time() - me0) / requests
        ok = len(tally.client_ms)
        print(f"  {n:>5} candidates: {percentiles(tally.client_ms)}  {ok / wall:6.1f} req/s  "
              f"server CPU {server_cpu:5.2f} ms/req  client CPU {client_cpu:4.2f} ms/req  "
              f"errors {requests - ok}")  # fmt: skip
        FIGURES.append((f"closed loop, {concurrency} clients, {n} candidates: req/s, p50 / p99, server CPU per request",
                        f"{ok / wall:.0f} req/s, {percentiles(tally.client_ms)}, {server_cpu:.2f} ms"))  # fmt: skip
        print(f"        server-side total {percentiles(tally.server_ms)}  fallbacks {dict(tally.fallbacks)}")
        print(f"        {breakdown(before, after)}")


def breakdown(before: dict, after: dict) -> str:
    """Mean wall ms per phase of the requests answered between two stats snapshots (the server's own clocks)."""
    n = after["answered"] - before["answered"]
    if n <= 0:
        return "breakdown: no answered requests"
    names = ("parse", "features", "queue", "build", "score", "encode", "total")
    ms = {k: (after["phase_ms_sum"].get(k, 0) - before["phase_ms_sum"].get(k, 0)) / n for k in names}
    return "breakdown (mean wall ms, server side): " + "  ".join(f"{k} {v:.2f}" for k, v in ms.items())


# ------------------------------------------------------------------------------------------ 2. compare
def shared_vs_recompute(
    model_uri: str, sizes: list[int], reps: int, loop_sample: int, compiled: bool = False
) -> None:
    import torch

    from models.inference import one_user
    from models.training.batch import Candidates, Events, Profile
    from serving import runtime
    from serving.model_source import load_served_model
    from serving.scorer import UserInputs, score_recompute, score_shared

    runtime.configure(1)  # as the server: 1 intra-op thread, heap-kept allocations
    served = load_served_model(model_uri)
    cfg, ranker = served.cfg, served.ranker
    scripted = ranker.script_one_user()  # as the server scores (scoring.torchscript)
    vocab = {
        f: ranker.sparse.table(f).shape[0] - 1 for f in ("ad_id", "action", "category_id", "advertiser_id")
    }
    g = torch.Generator().manual_seed(0)

    def ints(high: int, n: int) -> torch.Tensor:
        return torch.randint(0, high, (n,), generator=g)

    e = cfg.recent_events
    events = Events(ints(vocab["ad_id"], e), ints(vocab["action"], e), torch.zeros(e, dtype=torch.int64),
                    ints(vocab["category_id"], e), ints(vocab["advertiser_id"], e), torch.arange(e) * 60,
                    ints(cfg.time_buckets, e), torch.tensor([0, e]))  # fmt: skip
    profile = Profile(torch.tensor([1]), torch.tensor([1]), torch.tensor([1]), torch.tensor([[0.0]]))
    tokens = None
    if ranker.user_proj is not None:
        tokens = torch.randn(1, cfg.num_user_tokens, ranker.user_proj.in_features, generator=g)
    user = UserInputs(events, profile, tokens)
    mask = None if tokens is None else torch.ones(1, dtype=torch.bool)

    @torch.inference_mode()
    def per_candidate_calls(cands: Candidates, count: int) -> np.ndarray:
        """A naive server: for each candidate, the user side and then that one candidate."""
        out = []
        for i in range(count):
            side = ranker.user_side(user.recent, user.profile, user.user_tokens, mask)
            out.append(torch.sigmoid(ranker.score(side, cands.select(torch.tensor([i])))))
        return torch.cat(out).numpy()

    one = ranker.one_user_scorer()  # None for models the one-user path does not serve (pooling ablations)
    gemms = "" if one is None else f", {one_user.variant_of(one)}"
    if one is not None:
        from models.attention.shared_context import FusedAttention

        fused = isinstance(one.blocks[0].attention, FusedAttention)
        gemms += ", gemflow's fused attention" if fused else ", attention in PyTorch ops"
    print("\n== shared K/V vs recomputing the user side per candidate (in process, same model and inputs)")
    print(f"   model {served.version}: d_model {cfg.d_model}, {cfg.num_layers} blocks, {e} recent events "
          f"+ {0 if tokens is None else cfg.num_user_tokens} user tokens; 1 torch thread; CPU ms (best of {reps}); "
          f"shared: {'TorchScript one-user path' if scripted else 'eager'}{gemms}")  # fmt: skip
    print(
        f"   naive loop: timed on the first {loop_sample} candidates, x N / {loop_sample} (each call is alike)"
    )
    for n in sizes:
        cands = Candidates(ints(vocab["ad_id"], n), ints(vocab["advertiser_id"], n), ints(vocab["category_id"], n),
                           torch.zeros(n, dtype=torch.int64), torch.randn(n, len(served.dense.columns), generator=g),
                           torch.tensor([0, n]))  # fmt: skip
        shared = score_shared(ranker, user, cands, 2048)
        t_shared = min(_cpu_ms(lambda c=cands: score_shared(ranker, user, c, 2048)) for _ in range(reps))
        batched = score_recompute(ranker, user, cands)
        t_batched = min(
            _cpu_ms(lambda c=cands: score_recompute(ranker, user, c)) for _ in range(max(1, reps // 2))
        )
        sample = min(n, loop_sample)
        naive = per_candidate_calls(cands, sample)
        t_naive = _cpu_ms(lambda c=cands, k=sample: per_candidate_calls(c, k)) * n / sample
        diff = max(np.abs(shared - batched).max(), np.abs(shared[:sample] - naive).max())
        print(f"  {n:>5} candidates: shared {t_shared:8.2f} ms | per-candidate calls {t_naive:9.1f} ms "
              f"({t_naive / t_shared:6.1f}x) | batched recompute {t_batched:8.1f} ms ({t_batched / t_shared:5.1f}x)"
              f" | max |diff| {diff:.1e}")  # fmt: skip
    if one is not None:
        varied_counts(ranker, user, sizes, ints, vocab, served)
    if compiled:
        compiled_scorer(ranker, user, sizes, reps, ints, vocab, served)


def varied_counts(ranker, user, sizes, ints, vocab, served, requests: int = 400) -> None:
    """Requests of varied candidate counts (uniform within +-20% of each size, as retrieval hands them over): the
    one-user scorer on exactly N rows vs on rows padded to ``bucket_rows(N)`` (``one_user.score_padded``, what
    serving runs), alternating; CPU ms of the scorer call per request over the second half (the first warms the
    GEMM kernels each shape needs)."""
    import random
    import statistics

    import torch

    from models.inference import one_user
    from models.training.batch import Candidates

    print(
        f"   varied candidate counts ({requests} requests), scorer CPU ms per request over the last half, median / mean:"
    )
    rng = random.Random(0)
    with torch.inference_mode():
        mask = None if user.user_tokens is None else torch.ones(1, dtype=torch.bool)
        side = ranker.user_side(user.recent, user.profile, user.user_tokens, mask)
        scorer, args = ranker.one_user_scorer(), (side.kv, side.profile.reshape(-1))
        for n in sizes:
            ms: dict[str, list[float]] = {"exact rows": [], "padded rows": []}
            for i in range(requests):  # the two variants alternate; odd counts: never a padded size
                count = rng.randint(int(n * 0.8), int(n * 1.2)) | 1
                cands = Candidates(ints(vocab["ad_id"], count), ints(vocab["advertiser_id"], count),
                                   ints(vocab["category_id"], count), torch.zeros(count, dtype=torch.int64),
                                   torch.randn(count, len(served.dense.columns)), torch.tensor([0, count]))  # fmt: skip
                q = ranker.candidate_queries(cands, project=True)
                if i % 2 == 0:
                    t = _cpu_ms(lambda q=q: scorer(q.token, q.first_query, *args))
                else:
                    t = _cpu_ms(lambda q=q: one_user.score_padded(scorer, q.token, q.first_query, *args))
                if i >= requests // 2:
                    ms["padded rows" if i % 2 else "exact rows"].append(t)
            figures = " | ".join(
                f"{k} {statistics.median(v):6.2f} / {statistics.mean(v):6.2f}" for k, v in ms.items()
            )
            print(f"  {n:>5} candidates +-20%: {figures}")


def compiled_scorer(ranker, user, sizes, reps, ints, vocab, served) -> None:
    """The shared-K/V scorer three ways, CPU ms per request side by side: the eager one-user path, ``Ranker.score``
    compiled by inductor (dynamic candidate count), and the TorchScript one-user path the server runs
    (``models.inference.one_user``); the user side stays eager (once per request, a few small ops)."""
    import torch

    from models.attention.dispatch import stop_compiles_at_boundaries
    from models.inference.compile import use_cache_dir
    from models.inference.one_user import OneUserScorer
    from models.training.batch import Candidates
    from serving.scorer import score_shared

    use_cache_dir()
    stop_compiles_at_boundaries()
    eager_score, scripted = ranker.score, ranker.one_user_scorer()
    fast = torch.compile(eager_score, dynamic=True)
    print(
        "\n== shared K/V scorer: eager vs compiled by inductor vs TorchScript (CPU ms per request, best of reps)"
    )
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        cands = Candidates(ints(vocab["ad_id"], n), ints(vocab["advertiser_id"], n), ints(vocab["category_id"], n),
                           torch.zeros(n, dtype=torch.int64), torch.randn(n, len(served.dense.columns), generator=g),
                           torch.tensor([0, n]))  # fmt: skip
        ranker.__dict__["_one_user"] = OneUserScorer(ranker)  # the same path, eager
        ref = score_shared(ranker, user, cands, 2048)
        t_eager = min(_cpu_ms(lambda c=cands: score_shared(ranker, user, c, 2048)) for _ in range(reps))
        ranker.score = fast
        t0 = time.perf_counter()
        out = score_shared(ranker, user, cands, 2048)  # the first call compiles (or hits the cache)
        first = time.perf_counter() - t0
        t_comp = min(_cpu_ms(lambda c=cands: score_shared(ranker, user, c, 2048)) for _ in range(reps))
        ranker.score = eager_score
        line = (f"  {n:>5} candidates: eager {t_eager:8.2f} ms | compiled {t_comp:8.2f} ms ({t_eager / t_comp:5.2f}x,"
                f" first call {first:5.1f} s, max |diff| {np.abs(out - ref).max():.1e})")  # fmt: skip
        if isinstance(scripted, torch.jit.ScriptModule):
            ranker.__dict__["_one_user"] = scripted
            out = score_shared(ranker, user, cands, 2048)
            t_script = min(_cpu_ms(lambda c=cands: score_shared(ranker, user, c, 2048)) for _ in range(reps))
            line += (f" | TorchScript {t_script:8.2f} ms ({t_eager / t_script:5.2f}x,"
                     f" max |diff| {np.abs(out - ref).max():.1e})")  # fmt: skip
        print(line)
    ranker.__dict__["_one_user"] = scripted


def user_reads(workspace: Path, users: list[int], reads: int = 500) -> None:
    """CPU ms per user-side read of the serving feature service, in process on the bench world's store: Feast's
    ``get_online_features(...).to_dict()`` against the ``ServiceReader`` the server reads through."""
    from features.feature_repo.online_read import ServiceReader
    from features.store import open_store
    from gemflow.workspace import Workspace
    from serving.predictor import USER_SERVICE

    store = open_store(Workspace(workspace))
    service, fast = store.get_feature_service(USER_SERVICE), ServiceReader(store, USER_SERVICE)
    ways = {
        "Feast get_online_features": lambda u: store.get_online_features(
            features=service, entity_rows=[{"user_id": u}]
        ).to_dict(),
        "ServiceReader (served)": lambda u: fast.read([u]),
    }
    assert all(ways["Feast get_online_features"](u) == fast.read([u]) for u in users)
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(5):  # alternating rounds, best of each
        for name, read in ways.items():
            ms = _cpu_ms(lambda read=read: [read(users[i % len(users)]) for i in range(reads)]) / reads
            best[name] = min(best[name], ms)
    print(f"\n== user-side feature read ({USER_SERVICE}, {store.config.online_store.type} store), CPU ms per read "
          f"(best of 5 rounds of {reads}): " + " | ".join(f"{k} {v:.3f}" for k, v in best.items()))  # fmt: skip


def _cpu_ms(fn) -> float:
    t0 = time.process_time()
    fn()
    return 1e3 * (time.process_time() - t0)


# --------------------------------------------------------------------------------------------- 3. soak
def send_open_loop(base: str, bodies: list[bytes], rate: float, total: int, on_reply=None, desc="open loop"):
    """``total`` predict requests at ``rate``/s from 32 senders, each timed from when it was due (a late send counts
    as latency: open loop); ``on_reply(status, payload)`` sees every answer. Returns (tally, wall seconds)."""
    tally, local = Tally(), threading.local()

    def one(i: int, due: float) -> None:
        if not hasattr(local, "client"):
            local.client = Client(base, timeout=10)
        t0 = min(due, time.perf_counter())
        try:
            status, payload = local.client.post(PREDICT, bodies[i % len(bodies)])
        except OSError as err:
            status, payload = type(err).__name__, None
        tally.record(1e3 * (time.perf_counter() - t0), status, payload)
        if on_reply is not None:
            on_reply(status, payload)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        for i in tqdm(range(total), desc=desc, leave=False, disable=None, mininterval=2):
            due = start + i / rate
            if (wait := due - time.perf_counter()) > 0:
                time.sleep(wait)
            pool.submit(one, i, due)
    return tally, time.perf_counter() - start


def run_soak(base, rng, users, num_ads, n, rate: float, seconds: float, proc, request_ts: float) -> None:
    """Open loop at ``rate`` requests/s for ``seconds`` (bounded; stops by itself), RSS sampled every second."""
    print(f"\n== soak: {rate:.0f} req/s x {seconds:.0f} s, {n} candidates per request (open loop)")
    total = int(rate * seconds)
    bodies = [request_body(rng, users, num_ads, n, request_ts) for _ in range(min(total, 500))]
    rss: list[tuple[int, int]] = []  # (server process, its children: the ad-table refresh process)
    done = threading.Event()

    def sample_rss() -> None:
        while proc is not None and not done.is_set():
            children = 0
            for child in proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    children += child.memory_info().rss
            rss.append((proc.memory_info().rss, children))
            done.wait(1.0)

    before = get_json(base, f"/v2/models/{MODEL}/stats")[1]["stats"]
    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    cpu0 = cpu_seconds(proc)
    tally, wall = send_open_loop(base, bodies, rate, total, desc="soak")
    server_cpu = 1e3 * (cpu_seconds(proc) - cpu0) / total
    done.set()
    sampler.join()
    after = get_json(base, f"/v2/models/{MODEL}/stats")[1]["stats"]
    counted = {k.split()[1]: v - before["responses"].get(k, 0) for k, v in after["responses"].items()
               if k.startswith("v1_predict ") and v - before["responses"].get(k, 0)}  # fmt: skip
    shed = {k: v - before["shed"].get(k, 0) for k, v in after["shed"].items()}
    print(f"  sent {total} in {wall:.1f} s ({total / wall:.1f} req/s), status counts {dict(tally.codes)}")
    print(
        f"  latency {percentiles(tally.client_ms)}; 5xx (shed 503s included) or transport errors: {tally.server_errors}"
    )
    print(f"  server-side total {percentiles(tally.server_ms)} (handler start to scored: no HTTP)")
    print(f"  server counted by status {counted} (sum {sum(counted.values())} of {total} sent); shed {shed}; "
          f"server CPU {server_cpu:.2f} ms/request")  # fmt: skip
    print(
        f"  fallbacks {dict(tally.fallbacks)} (degraded {sum(tally.fallbacks.values())} of {len(tally.server_ms)})"
    )
    print(f"  {breakdown(before, after)}")
    FIGURES.append((f"open loop {rate:.0f} req/s x {seconds:.0f} s, {n} candidates: latency, degraded, server CPU per request",
                    f"{percentiles(tally.client_ms)}, {sum(tally.fallbacks.values())} of {total}, {server_cpu:.2f} ms"))  # fmt: skip
    if rss:
        both = np.array(rss) / 2**20
        for name, mib in (("server", both[:, 0]), ("its child processes", both[:, 1])):
            half = mib[len(mib) // 2 :]
            slope = np.polyfit(np.arange(len(half)), half, 1)[0] * 60 if len(half) > 2 else float("nan")
            print(f"  {name} RSS start {mib[0]:.0f} MiB, end {mib[-1]:.0f} MiB, peak {mib.max():.0f} MiB "
                  f"({mib[-1] - mib[0]:+.1f} MiB; second half trend {slope:+.1f} MiB/min)")  # fmt: skip


# ------------------------------------------------------------------------------------------- the server
def start_server(
    world_dir: Path, port: int, max_candidates: int, d_model: int, cold_start: bool, settings=()
):
    from tests.serving.world import HEALTHY_USERS, KNOWN_USERS, build_world

    world_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"building a bench world in {world_dir} (6,000 ads, ranker d_model {d_model}, 64 recent events) ..."
    )
    world = build_world(world_dir, num_ads=6000, d_model=d_model, max_recent=64)
    cmd = [sys.executable, "-m", "gemflow.cli", "serve", "--workspace", str(world.ws.root),
           "--model-uri", str(world.model_path), "--http-port", str(port),
           "--set", f"limits.max_candidates={max_candidates}"]  # fmt: skip
    for setting in settings:
        cmd += ["--set", setting]
    log = open(world_dir / "serve.log", "wb")  # noqa: SIM115 (the server process owns it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    # the normal path unless asked: users 2 (old embedding version) and 4 (no embedding) are cold starts
    return proc, world.model_path, world.ws.root, list(KNOWN_USERS if cold_start else HEALTHY_USERS), 6000


def wait_ready(base: str, proc: subprocess.Popen | None, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if get_json(base, f"/v2/models/{MODEL}/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server at {base} not ready within {timeout:.0f} s")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="", help="base URL of a running server (127.0.0.1 only)")
    ap.add_argument("--build-world", type=Path, help="build a bench world here and start its server")
    ap.add_argument("--port", type=int, default=18080, help="port of the --build-world server")
    ap.add_argument("--model-uri", default="", help="the served model (for the in-process comparison)")
    ap.add_argument("--pid", type=int, default=0, help="server pid (CPU per request, RSS)")
    ap.add_argument("--workspace", type=Path, help="the server's workspace (for the in-process feature read)")
    ap.add_argument("--users", default="0,1,3", help="user ids to sample (a running server of your own)")
    ap.add_argument("--num-ads", type=int, default=6000, help="candidates are sampled from ids [0, num_ads)")
    ap.add_argument("--requests", type=int, default=300, help="requests per candidate-set size")
    ap.add_argument("--concurrency", type=int, default=2, help="closed-loop clients (about one per core)")
    ap.add_argument("--sizes", default="100,1000,5000")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of the in-process comparison")
    ap.add_argument("--loop-sample", type=int, default=200, help="candidates timed for the naive loop")
    ap.add_argument("--soak", type=float, default=60.0, help="seconds of the open-loop soak (0 = skip)")
    ap.add_argument("--rate", type=float, default=100.0, help="requests/s of the soak")
    ap.add_argument("--soak-candidates", type=int, default=1000)
    ap.add_argument("--only", choices=PHASES, action="append", help="run only these phases (repeatable)")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="compare: also time the shared-K/V scorer eager vs compiled by inductor vs TorchScript",
    )
    ap.add_argument(
        "--server-set",
        action="append",
        metavar="KEY=VALUE",
        help="a serving-config override for the --build-world server (repeatable)",
    )
    ap.add_argument("--d-model", type=int, default=64, help="ranker width of the --build-world model")
    ap.add_argument(
        "--cold-start",
        action="store_true",
        help="also sample the bench world's cold-start users (2: old embedding version, 4: none)",
    )
    add_record_flag(ap)
    args = ap.parse_args()
    phases = set(args.only or PHASES)

    proc = None
    users = [int(u) for u in args.users.split(",")]
    if args.build_world:
        proc, model_path, args.workspace, users, args.num_ads = start_server(
            args.build_world, args.port, 5000, args.d_model, args.cold_start, args.server_set or ()
        )
        args.url, args.model_uri, args.pid = f"http://127.0.0.1:{args.port}", str(model_path), proc.pid
    if urllib.parse.urlparse(args.url).hostname not in ("127.0.0.1", "localhost"):
        raise SystemExit(
            f"--url must point at 127.0.0.1 (got {args.url!r}): this bench only drives a local server"
        )
    from tests.serving.world import REQUEST_TS

    sizes = [int(s) for s in args.sizes.split(",")]
    server = psutil.Process(args.pid) if args.pid else None
    try:
        wait_ready(args.url, proc)
        rng = np.random.default_rng(0)
        print(f"server {args.url} (pid {args.pid or '?'}), {os.cpu_count()} CPUs ({cpu_model()}), "
              f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
        if "latency" in phases:
            run_latency(args.url, rng, users, args.num_ads, sizes, args.requests, args.concurrency, server,
                        float(REQUEST_TS))  # fmt: skip
        if "compare" in phases and args.model_uri:
            shared_vs_recompute(args.model_uri, sizes, args.reps, args.loop_sample, args.compile)
        if "compare" in phases and args.workspace:
            user_reads(args.workspace, users)
        if "soak" in phases and args.soak > 0:
            run_soak(args.url, rng, users, args.num_ads, args.soak_candidates, args.rate, args.soak, server,
                     float(REQUEST_TS))  # fmt: skip
        stats = get_json(args.url, f"/v2/models/{MODEL}/stats")[1]
        print(f"\nserver stats: {stats['stats']}")
        print(f"server pauses (GC per generation, event-loop lag over the last minute): {stats['pauses']}")
        if args.record and FIGURES:
            record("serve", "serving over HTTP, 1,000-candidate requests (bench/serve.py)", FIGURES)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    main()
