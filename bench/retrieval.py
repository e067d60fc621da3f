"""Candidate retrieval: ANN index build, memory, per-query latency on one core, recall against exact search.

    # a synthetic 1,000,000-ad catalog at the user model's width (configs/sequential.yaml: d 64)
    .venv/bin/python bench/retrieval.py synthetic --ads 1000000 --record
    # a trained next-item user model on a leave-one-out set (Sports / Toys): its own ad vectors and test queries
    .venv/bin/python bench/retrieval.py sequential --workspace /tmp/retr/toys --training-set toys \
        --run /tmp/retr/toys/run2 --record
    # what a request's fresh query costs against the cached one: that model over the workspace's recent lists
    .venv/bin/python bench/retrieval.py fresh-query --workspace /tmp/retr/toys --run /tmp/retr/toys/run2

Synthetic vectors are unit vectors around 2,000 centres (learned item spaces cluster; uniform noise in 64
dimensions has no near neighbours and flatters no index). Queries come from the same mixture, scaled by 1 / 0.05
like the model's (cosine / temperature). Search timings run FAISS on one thread, one query at a time, K = 1,000.
On ``sequential``: overlap of each index's top-K with the exact top-K, and the held-out test item's hit rate in
the top K of exact search, of each index and of popularity. On ``fresh-query``: the query of one request, one
at a time (``Snapshot.query``, the server's call), fresh (the user model over the user's recent-event list as
the pipeline wrote it; the server's TorchScript one-user path and the eager batched one) against cached (a
lookup), on ``--torch-threads`` threads; the cached queries are the refresh's computation batched over the same
lists, so their largest difference to the fresh ones is reported too.

Feast's vector search (``retrieve_online_documents_v2``, sqlite-vec) is reported as unavailable when its SQLite
store cannot load sqlite-vec in this interpreter (Feast 0.67 loads it on Python 3.10 only).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import faiss  # noqa: E402

from bench.report import add_record_flag, record  # noqa: E402
from models.embeddings.ad_vectors import AdVectors  # noqa: E402
from serving.retrieval.eligibility import AdEligibility, AdFilter  # noqa: E402
from serving.retrieval.index import IndexConfig, build_index  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VERSION = "bench/1"


def model_width() -> int:
    import yaml

    return int(yaml.safe_load((ROOT / "configs" / "sequential.yaml").read_text())["user_model"]["d_model"])


def clustered(n: int, d: int, centres: int, draw_seed: int) -> np.ndarray:
    """Unit vectors around ``centres`` fixed centres; ``draw_seed`` picks which ones and their noise."""
    c = np.random.default_rng(0).standard_normal((centres, d)).astype(np.float32)
    rng = np.random.default_rng(draw_seed)
    out = np.empty((n, d), np.float32)
    for start in range(0, n, 100_000):  # in chunks: the noise of 1M x 64 at once doubles peak memory
        m = min(100_000, n - start)
        x = c[rng.integers(0, centres, m)] + 0.5 * rng.standard_normal((m, d)).astype(np.float32)
        out[start : start + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def feast_vector_search() -> str:
    """Why Feast's sqlite-vec search cannot run here, or that it can."""
    import feast

    if sys.version_info[:2] != (3, 10):
        return (
            f"unavailable: Feast {feast.__version__}'s SQLite online store loads sqlite-vec only on Python 3.10 "
            f"(feast/infra/online_stores/sqlite.py `_get_conn`); this is Python {sys.version_info[0]}."
            f"{sys.version_info[1]}, and sqlite-vec is not installed"
        )
    return "available (not measured by this bench yet)"


def time_searches(index, queries: np.ndarray, k: int, flt: AdFilter | None, exact: bool = False):
    """(ms per query, results): one query at a time, as a request would."""
    ms, results = [], []
    for q in queries:
        t0 = time.perf_counter()
        results.append(index.search(q, VERSION, k, flt, exact=exact))
        ms.append(1e3 * (time.perf_counter() - t0))
    return np.array(ms), results


def overlap(results, reference, k: int) -> float:
    return float(
        np.mean(
            [
                len(set(r.ad_ids[:k]) & set(e.ad_ids[:k])) / max(1, len(e.ad_ids[:k]))
                for r, e in zip(results, reference, strict=True)
            ]
        )
    )


# ----------------------------------------------------------------------------------------------- synthetic
def synthetic(args) -> list[tuple[str, str]]:
    d = model_width()
    rows: list[tuple[str, str]] = []
    t0 = time.perf_counter()
    vecs = AdVectors(np.arange(args.ads, dtype=np.int64), clustered(args.ads, d, 2000, 1), VERSION)
    queries = clustered(args.queries, d, 2000, 2) * 20.0  # the same centres, other draws
    rng = np.random.default_rng(3)
    elig = AdEligibility(
        rng.random(args.ads) < 0.02, np.full(args.ads, 31, np.int64), rng.integers(0, 1000, args.ads)
    )
    narrow = AdFilter(exclude_advertisers=tuple(range(0, 1000)[: int(1000 * 0.9)]))  # ~90% of the catalog out
    print(
        f"# {args.ads:,} ads x d {d}: generated in {time.perf_counter() - t0:.1f} s; load {os.getloadavg()[0]:.1f}"
    )

    faiss.omp_set_num_threads(args.build_threads)
    exact = build_index(vecs, IndexConfig(kind="exact", max_k=args.k), elig)
    faiss.omp_set_num_threads(1)
    exact_ms, truth = time_searches(exact, queries, args.k, None)
    exact_ms_f, truth_narrow = time_searches(exact, queries[: args.filtered_queries], args.k, narrow)
    rows.append((f"exact (flat) search, K {args.k}, p50 / p99 (1 core); filter excluding 90%",
                 f"{np.percentile(exact_ms, 50):.1f} / {np.percentile(exact_ms, 99):.1f} ms; "
                 f"{np.percentile(exact_ms_f, 50):.1f} / {np.percentile(exact_ms_f, 99):.1f} ms"))  # fmt: skip
    print(rows[-1])
    del exact
    for kind in args.kinds.split(","):
        cfg = IndexConfig(kind=kind, max_k=args.k, default_k=args.k, hnsw_m=args.hnsw_m,
                          ef_construction=args.ef_construction)  # fmt: skip
        faiss.omp_set_num_threads(args.build_threads)
        before = rss_mb()
        index = build_index(vecs, cfg, elig)
        faiss.omp_set_num_threads(1)
        size_mb = index.nbytes / 2**20
        built = (
            f"{kind} (M {cfg.hnsw_m}, efC {cfg.ef_construction})"
            if kind == "hnsw"
            else f"ivf ({index.ann.nlist} lists)"
        )
        print(f"{built}: build {index.build_seconds:.1f} s ({args.build_threads} threads), {size_mb:.0f} MB "
              f"(peak RSS +{rss_mb() - before:.0f} MB)", flush=True)  # fmt: skip
        rows.append(
            (
                f"{built}: build ({args.build_threads} threads) / memory",
                f"{index.build_seconds:.1f} s / {size_mb:.0f} MB",
            )
        )
        # one build, several beams: the search reads its beam from the index's config at each call
        for beam in (args.ef_search if kind == "hnsw" else args.nprobe).split(","):
            if kind == "hnsw":
                cfg.ef_search = int(beam)
            else:
                cfg.nprobe = int(beam)
            label = f"{kind} {'ef' if kind == 'hnsw' else 'nprobe'} {beam}"
            ms, found = time_searches(index, queries, args.k, None)
            ms_f, found_f = time_searches(index, queries[: args.filtered_queries], args.k, narrow)
            rec, rec_f = overlap(found, truth, args.k), overlap(found_f, truth_narrow, args.k)
            met = np.mean([len(r.ad_ids) == args.k for r in found_f])
            rows += [
                (f"{label}: search K {args.k} p50 / p99 (1 core), recall@{args.k} vs exact",
                 f"{np.percentile(ms, 50):.2f} / {np.percentile(ms, 99):.2f} ms, {rec:.4f}"),
                (f"{label}, filter excluding 90%: p50 / p99, recall@{args.k}, K met",
                 f"{np.percentile(ms_f, 50):.2f} / {np.percentile(ms_f, 99):.2f} ms, {rec_f:.4f}, {met:.2f}"),
            ]  # fmt: skip
            print(rows[-2], rows[-1], sorted({r.method for r in found_f}), flush=True)
        del index
    rows.append(("Feast vector search (sqlite-vec)", feast_vector_search()))
    rows.append(("catalog / queries / load average (1 min) at the end",
                 f"{args.ads:,} ads x d {d} / {args.queries} ({args.filtered_queries} filtered) / {os.getloadavg()[0]:.1f}"))  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------- sequential
def sequential(args) -> list[tuple[str, str]]:
    import torch

    from gemflow.workspace import Workspace
    from models.embeddings.ad_vectors import user_queries
    from models.inference.bundle import load_bundle
    from models.sequential.data import SequenceSet
    from models.training.data import TrainingSet

    torch.set_num_threads(args.build_threads)
    bundle = load_bundle(args.run)
    model = bundle.model.eval()
    with torch.no_grad():
        vecs = AdVectors(np.arange(model.num_items, dtype=np.int64), model.item_vectors().numpy(), VERSION)
    seqs = SequenceSet(TrainingSet(Workspace(Path(args.workspace)).training(args.training_set)),
                       bundle.cfg.max_history, bundle.cfg.time_buckets)  # fmt: skip
    users = np.random.default_rng(0).permutation(seqs.num_users)[: args.queries]
    queries = np.concatenate([user_queries(bundle, *seqs.eval_history(users[i : i + 512], "test"))
                              for i in range(0, len(users), 512)])  # fmt: skip
    target = seqs.targets("test")[users]
    popular = np.argsort(-seqs.train_counts()[: model.num_items], kind="stable")
    ks = (100, 500, 1000)
    name = args.training_set
    print(f"# {name}: {len(vecs.ad_ids):,} items, {len(users)} test users, d {vecs.dim}, {args.run}")
    faiss.omp_set_num_threads(1)
    exact = build_index(vecs, IndexConfig(kind="exact"))
    _, truth = time_searches(exact, queries, max(ks), None)

    def hit(results, k):
        return float(np.mean([t in set(r.ad_ids[:k]) for r, t in zip(results, target, strict=True)]))

    def ndcg10(results):
        out = []
        for r, t in zip(results, target, strict=True):
            pos = np.flatnonzero(r.ad_ids[:10] == t)
            out.append(1 / np.log2(pos[0] + 2) if len(pos) else 0.0)
        return float(np.mean(out))

    rows = [(f"{name}: test-item hit rate @{'/'.join(map(str, ks))}: exact | popularity",
             " / ".join(f"{hit(truth, k):.4f}" for k in ks) + " | "
             + " / ".join(f"{np.isin(target, popular[:k]).mean():.4f}" for k in ks))]  # fmt: skip
    for kind in args.kinds.split(","):
        cfg = IndexConfig(kind=kind, hnsw_m=args.hnsw_m, ef_construction=args.ef_construction,
                          ef_search=int(args.ef_search.split(",")[0]), nprobe=int(args.nprobe.split(",")[0]))  # fmt: skip
        index = build_index(vecs, cfg)
        ms, found = time_searches(index, queries, max(ks), None)
        recalls = " / ".join(f"{overlap(found, truth, k):.4f}" for k in ks)
        # retrieve 1,000 then rank them by the model's exact score: the ANN top-1000 already is in score order
        print(f"{kind}: recall@{ks} vs exact {recalls}; test-item hit {[round(hit(found, k), 4) for k in ks]}; "
              f"HR@10 {hit(found, 10):.4f} vs exact {hit(truth, 10):.4f}; NDCG@10 {ndcg10(found):.4f} vs "
              f"{ndcg10(truth):.4f}; p50 {np.percentile(ms, 50):.2f} ms", flush=True)  # fmt: skip
        rows += [
            (f"{name}, {kind}: recall@{'/'.join(map(str, ks))} vs exact", recalls),
            (f"{name}, {kind}: retrieve 1,000 -> rank by the user model, HR@10 / NDCG@10 (exact full catalog)",
             f"{hit(found, 10):.4f} / {ndcg10(found):.4f} ({hit(truth, 10):.4f} / {ndcg10(truth):.4f})"),
        ]  # fmt: skip
    rows.append((f"{name}: load average (1 min) at the end", f"{os.getloadavg()[0]:.1f}"))
    return rows


# ----------------------------------------------------------------------------------------------- fresh query
def fresh_query_cost(args) -> list[tuple[str, str]]:
    import pyarrow.parquet as pq
    import torch

    from features.feature_repo.offline import partition_days
    from gemflow.workspace import Workspace
    from models.embeddings.ad_vectors import UserQueries, ad_vectors
    from models.embeddings.sequences import UserSequences, query_vectors
    from models.inference.bundle import load_bundle
    from serving.retrieval.query import EVENT_COLUMNS, QueryModel, fresh_sequence, scripted_query
    from serving.retrieval.service import Snapshot
    from serving.user_features import UserFeatures

    torch.set_num_threads(args.torch_threads)
    faiss.omp_set_num_threads(1)
    ws, bundle = Workspace(Path(args.workspace)), load_bundle(args.run)
    day = partition_days(ws, "offline", "user_recent_events")[-1]
    table = pq.read_table(ws.offline("user_recent_events", day), columns=["user_id", *EVENT_COLUMNS.values()])
    picked = table.take(np.random.default_rng(0).permutation(table.num_rows)[: args.queries]).to_pylist()
    users = np.array([r["user_id"] for r in picked], np.int64)
    feats = [UserFeatures(None, None, None, {c: np.asarray(r[c], np.int64) for c in EVENT_COLUMNS.values()},
                          None, None) for r in picked]  # fmt: skip
    request_ts = float(max(int(f.recent["recent_ts"].max()) for f in feats) + 3600)
    window = [fresh_sequence(int(u), f.recent, request_ts, bundle.cfg.max_history, 1)
              for u, f in zip(users, feats, strict=True)]  # fmt: skip
    lens = np.array([int(w.offsets[-1]) for w in window])
    batched = UserSequences(users, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                            {f: np.concatenate([w.values[f] for w in window]) for f in window[0].values})  # fmt: skip
    cached = query_vectors(bundle, batched)  # the refresh's batched computation over the same events
    order = np.argsort(users)
    queries = UserQueries(users[order], cached[order], VERSION)
    index = build_index(ad_vectors(bundle, VERSION), IndexConfig(kind="exact", max_k=args.k))
    snaps = {
        kind: Snapshot(
            index, queries, "bench", cached.mean(0), query_model=QueryModel(bundle, VERSION, one_user)
        )
        for kind, one_user in (("scripted", scripted_query(bundle.model)), ("eager", None))
    }
    print(f"# {len(users)} users of {args.workspace} ({day}), {len(index):,} ads, d {index.dim}, events per "
          f"query {lens.mean():.1f} (max {lens.max()}), torch threads {args.torch_threads}", flush=True)  # fmt: skip

    def timed(fresh: bool, snap: Snapshot) -> tuple[np.ndarray, np.ndarray, list]:
        for u, f in list(zip(users, feats, strict=True))[:5]:  # warm-up (lazy kernels), not timed
            snap.query(int(u), f, request_ts, 1, fresh)
        ms, search_ms, out = [], [], []
        for u, f in zip(users, feats, strict=True):
            t0 = time.perf_counter()
            q = snap.query(int(u), f, request_ts, 1, fresh)
            t1 = time.perf_counter()
            index.search(q.vector, q.version, args.k)
            ms.append(1e3 * (t1 - t0))
            search_ms.append(1e3 * (time.perf_counter() - t1))
            out.append(q)
        return np.array(ms), np.array(search_ms), out

    fresh_ms, search_ms, fresh = timed(True, snaps["scripted"])
    eager_ms, _, eager = timed(True, snaps["eager"])
    cached_ms, _, looked_up = timed(False, snaps["scripted"])
    assert {q.kind for q in fresh + eager} == {"fresh"} and {q.kind for q in looked_up} == {"cached"}
    diff = max(float(np.abs(q.vector - c.vector).max()) for q, c in zip(fresh, looked_up, strict=True))
    p = lambda a: f"{np.percentile(a, 50):.3f} / {np.percentile(a, 99):.3f} ms"  # noqa: E731
    over = f"user model over <= {bundle.cfg.max_history} events"
    return [
        (f"query per request, fresh ({over}, TorchScript one-user path: the server's) p50 / p99", p(fresh_ms)),
        (f"query per request, fresh ({over}, eager batched path) p50 / p99", p(eager_ms)),
        ("query per request, cached (lookup) p50 / p99", p(cached_ms)),
        (f"for scale: exact search K {args.k} over {len(index):,} ads p50 / p99", p(search_ms)),
        ("largest |fresh - cached| over the same events (refresh batched vs one request, scripted)", f"{diff:.2e}"),
        ("users / events per query (mean) / torch threads / load average (1 min)",
         f"{len(users)} / {lens.mean():.1f} / {args.torch_threads} / {os.getloadavg()[0]:.1f}"),
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("synthetic", "sequential", "fresh-query"))
    ap.add_argument("--ads", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--filtered-queries", type=int, default=50)
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--kinds", default="hnsw,ivf")
    ap.add_argument("--hnsw-m", type=int, default=32)
    ap.add_argument("--ef-construction", type=int, default=80)
    ap.add_argument("--ef-search", default="1200", help="HNSW beams to measure, comma-separated (one build)")
    ap.add_argument("--nprobe", default="48", help="IVF cells probed, comma-separated (one build)")
    ap.add_argument("--build-threads", type=int, default=2)
    ap.add_argument(
        "--torch-threads", type=int, default=1, help="fresh-query: the scoring thread's torch threads"
    )
    ap.add_argument("--workspace", default="")
    ap.add_argument("--training-set", default="")
    ap.add_argument("--run", default="")
    add_record_flag(ap)
    args = ap.parse_args()
    modes = {"synthetic": synthetic, "sequential": sequential, "fresh-query": fresh_query_cost}
    rows = modes[args.mode](args)
    for figure, value in rows:
        print(f"  {figure}: {value}")
    if args.record:
        key = f"retrieval-{args.mode}-" + (
            args.training_set or Path(args.workspace).name
            if args.mode != "synthetic"
            else args.kinds.replace(",", "-")
        )
        record(key, f"candidate retrieval, {args.mode} (bench/retrieval.py)", rows)


if __name__ == "__main__":
    main()
