"""One index per node, built once: the index ``gemflow retrieval-index`` (or the refresh DAG) builds is written
beside the vectors it came from, and every server process memory-maps it instead of building its own (an IVF
index over 1M ads took ~7 minutes to build; mapping it takes milliseconds and its pages are shared by every
process of the node through the page cache).

    <refresh folder>/index/CURRENT            the name of the newest complete build (replaced atomically)
    <refresh folder>/index/<kind>-<stamp>/    ann.faiss, flat.faiss (IVF's exact copy), ad_ids.npy, meta.json

A build is written under a hidden temporary name and renamed whole, then ``CURRENT`` is replaced: a reader sees
the old build or the new one, never a half-written file. Older builds are deleted after the newest two; a
server still mapping one keeps reading it (an unlinked file lives on while it is mapped).

FAISS maps the vectors of flat, IVF (its inverted lists) and HNSW (its storage) indexes with
``IO_FLAG_MMAP_IFC``; the HNSW graph itself is read into memory.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import time
from pathlib import Path

import faiss
import numpy as np

from serving.retrieval.config import IndexConfig
from serving.retrieval.eligibility import AdEligibility
from serving.retrieval.index import AdIndex

INDEX_DIR = "index"
CURRENT = "CURRENT"
KEEP_BUILDS = 2
MMAP = faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY


def save_index(index: AdIndex, folder: Path) -> Path:
    """Write ``index`` under ``folder/index/`` and make it the current build; returns its directory."""
    root = Path(folder) / INDEX_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"{index.kind}-{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S%f}-{os.getpid()}"
    tmp = root / f".{name}.tmp"
    tmp.mkdir()
    faiss.write_index(index.ann, str(tmp / "ann.faiss"))
    if index.kind == "ivf":  # HNSW's storage and the flat index are the exact index already
        faiss.write_index(index.flat, str(tmp / "flat.faiss"))
    np.save(tmp / "ad_ids.npy", np.asarray(index.ad_ids, np.int64))
    meta = {"model_version": index.model_version, "kind": index.kind, "ads": len(index), "dim": index.dim,
            "build_seconds": index.build_seconds, "config": {f: getattr(index.cfg, f) for f in index.cfg.__dataclass_fields__},
            "created_at": dt.datetime.now(dt.UTC).isoformat()}  # fmt: skip
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
    tmp.rename(root / name)
    pointer = root / f".{CURRENT}.tmp"
    pointer.write_text(name)
    pointer.replace(root / CURRENT)
    for old in sorted((d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")),
                      key=lambda d: d.stat().st_mtime)[:-KEEP_BUILDS]:  # fmt: skip
        shutil.rmtree(old, ignore_errors=True)
    return root / name


def current_index(folder: Path) -> Path | None:
    """The directory of the newest complete build under ``folder`` (None when none was written)."""
    pointer = Path(folder) / INDEX_DIR / CURRENT
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if (path / "meta.json").exists() else None


def index_meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())


def load_index(path: Path, cfg: IndexConfig, eligibility: AdEligibility | None = None) -> AdIndex:
    """Map a build written by ``save_index``; the search settings (beams, K bounds) come from ``cfg``."""
    path = Path(path)
    meta = index_meta(path)
    start = time.perf_counter()
    ann = faiss.read_index(str(path / "ann.faiss"), MMAP)
    kind = meta["kind"]
    if kind == "hnsw":
        flat = faiss.downcast_index(ann.storage)
    elif kind == "ivf":
        flat = faiss.read_index(str(path / "flat.faiss"), MMAP)
    else:
        flat = ann
    ad_ids = np.load(path / "ad_ids.npy", mmap_mode="r")
    if len(ad_ids) != ann.ntotal:
        raise ValueError(f"{path}: {len(ad_ids)} ad ids for an index of {ann.ntotal} vectors")
    index = AdIndex(
        ann, flat, ad_ids, meta["model_version"], kind, cfg, eligibility, meta["build_seconds"], str(path)
    )
    index.load_seconds = time.perf_counter() - start
    return index
