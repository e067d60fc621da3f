"""A small positive-only sequence log with planted structure, in the S3-Rec file format.

Items come in themes (consecutive ids); a user picks a theme and buys its items in order from a random start,
with a few random items mixed in. So the next item follows from the last one (and from the theme, an item
attribute), while every item is about equally popular: a sequential model must beat popularity by far.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_sequence_log(
    folder: Path,
    *,
    users: int = 300,
    themes: int = 12,
    per_theme: int = 15,
    noise: float = 0.1,
    seed: int = 0,
) -> tuple[Path, Path]:
    """(sequence file, item-attribute JSON) under ``folder``; item ids from 1, attribute ids as text."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    num_items = themes * per_theme
    lines = []
    for user in range(1, users + 1):
        theme = rng.integers(themes)
        start = rng.integers(per_theme)
        length = int(rng.integers(5, 13))
        items = []
        for k in range(length):
            if rng.random() < noise:
                items.append(int(rng.integers(num_items)) + 1)
            else:
                items.append(int(theme * per_theme + (start + k) % per_theme) + 1)
        lines.append(" ".join(map(str, [user, *items])))
    sequences = folder / "log.txt"
    sequences.write_text("\n".join(lines) + "\n")
    attributes = {str(i + 1): [f"theme{i // per_theme}", f"brand{i % 3}"] for i in range(num_items)}
    attr_path = folder / "log_item2attributes.json"
    attr_path.write_text(json.dumps(attributes))
    return sequences, attr_path
