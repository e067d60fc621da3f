"""What an index built from one refresh costs and how well it recalls: ``gemflow retrieval-index``.

Builds the index from a refresh folder's ad vectors and writes it beside them (``index_files.save_index``: the
file every server process of the node maps instead of building its own), maps it as a server does
(``serving.retrieval.service.build_snapshot``, the same config), then searches a held-out sample of that
refresh's own user queries with it and with the exact index, one query at a time on one thread: recall@K of the
index against exact, per-query p50 / p99, build seconds and bytes. The report is written beside the vectors
(``index_report.json``) and, when tracking is on, logged as an MLflow run of the ``gemflow-retrieval``
experiment tagged with the user-model version.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import faiss
import numpy as np

from models.embeddings.ad_vectors import AD_VECTOR_FILE, read_ad_vectors
from serving.retrieval.config import IndexConfig
from serving.retrieval.index import build_index
from serving.retrieval.index_files import save_index
from serving.retrieval.service import build_snapshot

REPORT_FILE = "index_report.json"
EXPERIMENT = "gemflow-retrieval"


def index_report(folder: Path, cfg: IndexConfig, k: int = 1000, sample: int = 200, seed: int = 0) -> dict:
    built = build_index(read_ad_vectors(folder, AD_VECTOR_FILE), cfg)
    path = save_index(built, folder)
    del built  # measured as the servers will use it: mapped from the file just written
    snap = build_snapshot(folder, cfg)
    index = snap.index
    users = snap.queries.ad_ids
    pick = np.random.default_rng(seed).choice(len(users), min(sample, len(users)), replace=False)
    k = min(k, len(index), cfg.max_k)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # per-query latency as a request sees it
    try:
        ms, recall = [], []
        for row in pick:
            q = snap.queries.vectors[row]
            t0 = time.perf_counter()
            hits = index.search(q, snap.version, k)
            ms.append(1e3 * (time.perf_counter() - t0))
            exact = index.search(q, snap.version, k, exact=True)
            recall.append(
                len(set(hits.ad_ids.tolist()) & set(exact.ad_ids.tolist())) / max(1, len(exact.ad_ids))
            )
    finally:
        faiss.omp_set_num_threads(threads)
    return {
        "folder": str(folder),
        "model_version": snap.version,
        "kind": index.kind,
        "ads": len(index),
        "users": int(len(users)),
        "dim": index.dim,
        "build_seconds": round(index.build_seconds, 3),
        "index_path": str(path),
        "load_seconds": round(index.load_seconds, 4),
        "index_bytes": index.nbytes,
        "k": k,
        "sampled_users": int(len(pick)),
        f"recall_at_{k}": float(np.mean(recall)) if recall else None,
        "search_p50_ms": float(np.percentile(ms, 50)) if ms else None,
        "search_p99_ms": float(np.percentile(ms, 99)) if ms else None,
        "config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
        "created_at": dt.datetime.now(dt.UTC).isoformat(),
    }


def write_report(report: dict) -> Path:
    path = Path(report["folder"]) / REPORT_FILE
    path.write_text(json.dumps(report, indent=2))
    return path


def track_report(report: dict, ws=None, tracking_uri: str = "") -> str:
    """Log the report as one MLflow run; returns its id."""
    import mlflow

    from models.tracking.mlflow_store import connect

    connect(ws, tracking_uri)
    mlflow.set_experiment(EXPERIMENT)
    with mlflow.start_run(run_name=f"index {report['model_version']}") as run:
        mlflow.set_tags(
            {"gemflow.user_model_version": report["model_version"], "gemflow.index_kind": report["kind"]}
        )
        mlflow.log_params({f"index.{k}": v for k, v in report["config"].items()})
        metrics = {k: v for k, v in report.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if v is not None})
        mlflow.log_dict(report, REPORT_FILE)
        return run.info.run_id
