"""Training sets whose histories keep only some action types, with every example (and so the test split)
unchanged: the composition experiment compares diverse vs homogeneous histories at equal length.

Each example's ``cut`` is recounted as the number of kept events before its original cut, so an example still
sees exactly the events that happened before it, only fewer kinds of them (and, at a fixed history length,
reaching further back in time).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from features.schema import ACTION_ID, ACTIONS, HISTORY_FIELDS

MARKER = "derived.json"


def set_fingerprint(path: Path) -> str:
    """A short hash of a training set's manifest and file sizes (sweep keys change when the set does)."""
    h = hashlib.sha1()
    for name in ("manifest.json", "examples.parquet", "sequences.parquet", "ranker.parquet"):
        p = Path(path) / name
        if p.exists():
            h.update(name.encode())
            h.update(str(p.stat().st_size).encode())
            if name == "manifest.json":
                h.update(p.read_bytes())
    return h.hexdigest()[:12]


def filter_actions(src: Path, dst: Path, actions: tuple[str, ...]) -> Path:
    """Write ``dst``: ``src`` with history events of other action types removed. Idempotent."""
    src, dst = Path(src), Path(dst)
    if set(actions) == set(ACTIONS):
        return src
    wanted = {"source": str(src), "fingerprint": set_fingerprint(src), "actions": list(actions)}
    if (dst / MARKER).exists() and json.loads((dst / MARKER).read_text()) == wanted:
        return dst
    seq = pq.read_table(src / "sequences.parquet")
    action_col = seq.column("action").combine_chunks()
    offsets = action_col.offsets.to_numpy().astype(np.int64)
    offsets -= offsets[0]
    codes = action_col.flatten().to_numpy(zero_copy_only=False)
    keep = np.isin(codes, [ACTION_ID[a] for a in actions])
    kept_before = np.zeros(len(keep) + 1, np.int64)  # kept events among the first i flat events
    np.cumsum(keep, out=kept_before[1:])
    new_offsets = kept_before[offsets]

    columns = {}
    for name in seq.column_names:
        col = seq.column(name)
        if name in HISTORY_FIELDS:
            values = col.combine_chunks().flatten().to_numpy(zero_copy_only=False)[keep]
            columns[name] = pa.ListArray.from_arrays(pa.array(new_offsets.astype(np.int32)), pa.array(values))
        else:
            columns[name] = col
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pq.write_table(pa.table(columns), tmp / "sequences.parquet")

    def recut(frame: pd.DataFrame) -> pd.DataFrame:
        rows = frame["user_row"].to_numpy(np.int64)
        cut = frame["cut"].to_numpy(np.int64)
        frame = frame.copy()
        frame["cut"] = kept_before[offsets[rows] + cut] - kept_before[offsets[rows]]
        return frame

    recut(pd.read_parquet(src / "examples.parquet")).to_parquet(tmp / "examples.parquet", index=False)
    if (src / "ranker.parquet").exists():
        ranker = pq.read_table(src / "ranker.parquet")
        if "cut" in ranker.column_names:  # keep the exact arrow schema (list columns, nulls) of the rest
            frame = recut(ranker.select(["user_row", "cut"]).to_pandas())
            ranker = ranker.set_column(ranker.column_names.index("cut"), "cut", pa.array(frame["cut"]))
        pq.write_table(ranker, tmp / "ranker.parquet")
    manifest = json.loads((src / "manifest.json").read_text()) if (src / "manifest.json").exists() else {}
    manifest["history_actions"] = list(actions)
    manifest.setdefault("counts", {})["events"] = int(keep.sum())
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (tmp / MARKER).write_text(json.dumps(wanted))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
