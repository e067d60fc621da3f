"""How a training set's examples are split into train / valid / test.

- ``time``: by day, the last ``test_days`` are test, the ``valid_days`` before them valid (labelled impression
  logs: the model is judged on days it never saw).
- ``leave-one-out``: per user, the last positive is test, the second-last valid, the rest train (positive-only
  sequence logs, the protocol of SASRec / S3-Rec: every user is in every split, and time plays no part).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

SPLIT_MODES = ("time", "leave-one-out")


def leave_one_out_split(examples: pd.DataFrame) -> np.ndarray:
    """Split labels for positive-only logs: each user's last positive -> test, second-last -> valid,
    everything strictly before the valid positive -> train. The user's non-positive rows between the valid
    and the test positive also go to valid: without them valid holds positives only, its NE is undefined and
    early stopping keeps the untrained model. Other rows (users with < 3 positives) -> "" (unused)."""
    split = np.full(len(examples), "", dtype=object)
    pos = examples[examples["click"] > 0].sort_values(["user_id", "ts", "cut"], kind="stable")
    ranked = pos.groupby("user_id").cumcount(ascending=False)  # 0 = last positive
    counts = pos.groupby("user_id")["click"].transform("size")
    eligible = counts >= 3
    split[pos.index[(ranked == 0) & eligible]] = "test"
    split[pos.index[(ranked == 1) & eligible]] = "valid"
    valid_ts = pos[(ranked == 1) & eligible].set_index("user_id")["ts"]
    bound = examples["user_id"].map(valid_ts)
    train = bound.notna() & (examples["ts"] < bound)
    split[train.to_numpy()] = "train"
    test_ts = pos[(ranked == 0) & eligible].set_index("user_id")["ts"]
    upper = examples["user_id"].map(test_ts)
    between = bound.notna() & (examples["ts"] > bound) & (examples["ts"] < upper) & (examples["click"] <= 0)
    split[between.to_numpy()] = "valid"
    return split.astype(str)
