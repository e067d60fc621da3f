"""A training set whose valid split is a fixed random subsample of the source's (train and test unchanged).

In a sweep the valid split only picks each point's best epoch (one or two epochs: epoch 0 = the untrained
model), yet the trainer scores it after every epoch and again at the end: on the synthetic scaling set that is
3 x 31k examples per point, more CPU than a small model's whole epoch. A few thousand valid examples pick the
epoch as well; the test split, which every NE in the report comes from, keeps all its examples.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd

from models.scaling.composition import MARKER, set_fingerprint

DROPPED = "valid_unused"  # split label of the valid examples left out (no trainer reads it)
LINKED = ("sequences.parquet", "ranker.parquet")


def subsample_valid(src: Path, dst: Path, n: int, seed: int = 0) -> Path:
    """Write ``dst``: ``src`` with all but ``n`` valid examples relabelled ``valid_unused``. Idempotent;
    returns ``src`` itself when it has no more than ``n`` valid examples."""
    src, dst = Path(src), Path(dst)
    if n < 1:
        raise ValueError(f"valid_examples must be >= 1 to subsample the valid split, got {n}")
    examples = pd.read_parquet(src / "examples.parquet")
    valid = np.flatnonzero(examples["split"].astype(str).to_numpy() == "valid")
    if len(valid) <= n:
        return src
    wanted = {"source": str(src), "fingerprint": set_fingerprint(src), "valid_examples": n, "seed": seed}
    if (dst / MARKER).exists() and json.loads((dst / MARKER).read_text()) == wanted:
        return dst
    dropped = np.setdiff1d(valid, np.random.default_rng(seed).choice(valid, n, replace=False))
    examples.loc[examples.index[dropped], "split"] = DROPPED

    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    examples.to_parquet(tmp / "examples.parquet", index=False)
    for name in LINKED:  # unchanged files: hard links where the filesystem allows, else copies
        if (src / name).exists():
            try:
                os.link(src / name, tmp / name)
            except OSError:
                shutil.copy2(src / name, tmp / name)
    manifest = json.loads((src / "manifest.json").read_text()) if (src / "manifest.json").exists() else {}
    manifest.setdefault("counts", {})["examples_valid"] = n
    manifest["valid_subsample"] = {"kept": n, "of": len(valid), "seed": seed}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (tmp / MARKER).write_text(json.dumps(wanted))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
