"""Raw ids -> dense model rows: the one mapping that training, the embedding refresh and serving apply.

The offline and online stores stay keyed by raw ids (int64: integers as imported, text ids as their stable
63-bit hash, ``text_id``). Only model tables use rows. A ``Vocabulary`` is built with the training set from
the events a model may learn from (the training period), ordered by frequency (row 0 = the most frequent id)
and cut at ``min_count``; ids outside it map to ``OOV`` (-1), which every model table sends to its extra
out-of-vocabulary row. Catalogs too large to enumerate hash into ``hash_buckets`` rows instead. A table that
would exceed ``max_rows`` is refused before anything is trained.

Lookup is one ``np.searchsorted`` over the sorted raw ids (vectorised; ~1 µs per 100 ids at serving sizes).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

OOV = -1  # a raw id outside the vocabulary: the model tables' out-of-vocabulary row
VOCABULARY_FILE = "vocabulary.npz"
ID_FIELDS = ("user_id", "ad_id")  # the entity ids mapped to rows (attribute ids are small by construction)
MASK63 = (1 << 63) - 1


class VocabularyError(ValueError):
    """A vocabulary cannot be built as configured (a table too large, a bad setting)."""


@dataclass
class VocabularyConfig:
    min_count: int = 1  # ids seen fewer times in the training period map to the OOV row
    hash_buckets: int = 0  # > 0: rows = hash(id) mod buckets (catalogs too large to enumerate)
    max_rows: int = 20_000_000  # refuse a table larger than this (rows x d_model floats must fit memory)

    def check(self) -> None:
        if self.min_count < 1:
            raise VocabularyError(f"vocabulary.min_count must be >= 1, got {self.min_count}")
        if self.hash_buckets < 0 or self.max_rows < 1:
            raise VocabularyError("vocabulary.hash_buckets must be >= 0 and vocabulary.max_rows >= 1")
        if self.hash_buckets > self.max_rows:
            raise VocabularyError(
                f"vocabulary.hash_buckets {self.hash_buckets:,} exceeds vocabulary.max_rows {self.max_rows:,}"
            )


def text_id(text: str) -> int:
    """The raw int64 id of a text id: 64-bit BLAKE2b of its UTF-8 text, top bit cleared (stable across runs)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & MASK63


def raw_id(value: int | str) -> int:
    """A caller's id as the stores key it: an integer (or all-digit text) as it is, other text hashed."""
    if isinstance(value, bool):
        raise ValueError("an id is an integer or a string, not a boolean")
    if isinstance(value, int):
        if value < 0 or value > MASK63:
            raise ValueError(f"integer id {value} is outside [0, 2**63)")
        return value
    return _text_raw_id(str(value))


@functools.lru_cache(maxsize=1 << 20)  # a server sees the same text ids again and again: parse each once
def _text_raw_id(text: str) -> int:
    if not text:
        raise ValueError("an id must not be empty")
    if text.isascii() and text.isdigit() and int(text) <= MASK63:
        return int(text)
    return text_id(text)


def _mix(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads integer ids (sequential, strided) evenly over hash buckets."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@dataclass
class Vocabulary:
    """``ids``: the sorted raw ids known; ``rows``: the row of each (frequency order). ``buckets`` > 0: hashed."""

    field: str
    ids: np.ndarray  # (n,) int64 ascending
    rows: np.ndarray  # (n,) int64
    buckets: int = 0

    @property
    def size(self) -> int:
        """Rows of the model table (without its OOV row)."""
        return self.buckets or len(self.ids)

    @classmethod
    def build(cls, field: str, values: np.ndarray, cfg: VocabularyConfig) -> Vocabulary:
        """From every occurrence of ``field`` in the training period (one value per event or example)."""
        ids, counts = np.unique(np.asarray(values, np.int64), return_counts=True)
        return cls.from_counts(field, ids, counts, cfg)

    @classmethod
    def from_counts(
        cls, field: str, ids: np.ndarray, counts: np.ndarray, cfg: VocabularyConfig
    ) -> Vocabulary:
        """From each distinct id (ascending) and its occurrences in the training period (an engine that counts
        in a distributed way hands over only these)."""
        cfg.check()
        keep = counts >= cfg.min_count
        ids, counts = ids[keep], counts[keep]
        if cfg.hash_buckets:
            return cls(
                field, ids, (_mix(ids) % np.uint64(cfg.hash_buckets)).astype(np.int64), cfg.hash_buckets
            )
        if len(ids) > cfg.max_rows:
            raise VocabularyError(
                f"{field}: {len(ids):,} distinct ids exceed vocabulary.max_rows {cfg.max_rows:,}; hash them "
                f"into fewer rows with vocabulary.hash_buckets (e.g. --set vocabulary.hash_buckets=1000000) "
                "or raise vocabulary.min_count"
            )
        # Most frequent first; ties by raw id, so a rebuild from the same data gives the same rows.
        order = np.lexsort((ids, -counts))
        rows = np.empty(len(ids), np.int64)
        rows[order] = np.arange(len(ids))
        return cls(field, ids, rows)

    def lookup(self, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, known) for raw ids; unknown ids get row ``OOV`` (hashed vocabularies: their bucket)."""
        raw = np.asarray(raw, np.int64)
        if not len(self.ids):
            known = np.zeros(raw.shape, bool)
        else:
            at = np.minimum(np.searchsorted(self.ids, raw), len(self.ids) - 1)
            known = self.ids[at] == raw
        if self.buckets:
            return (_mix(raw) % np.uint64(self.buckets)).astype(np.int64), known
        return np.where(known, self.rows[at] if len(self.ids) else OOV, OOV), known

    def map(self, raw: np.ndarray) -> np.ndarray:
        return self.lookup(raw)[0]

    # ------------------------------------------------------------------------------------- persistence
    def to_payload(self) -> dict:
        return {"field": self.field, "ids": self.ids, "rows": self.rows, "buckets": int(self.buckets)}

    @classmethod
    def from_payload(cls, payload: dict) -> Vocabulary:
        return cls(
            str(payload["field"]),
            np.asarray(payload["ids"], np.int64),
            np.asarray(payload["rows"], np.int64),
            int(payload.get("buckets", 0)),
        )


def save_vocabularies(vocabularies: dict[str, Vocabulary], folder: Path) -> Path:
    arrays = {}
    for name, v in vocabularies.items():
        arrays[f"{name}.ids"], arrays[f"{name}.rows"] = v.ids, v.rows
        arrays[f"{name}.buckets"] = np.asarray(v.buckets, np.int64)
    path = Path(folder) / VOCABULARY_FILE
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return path


def load_vocabularies(folder: Path) -> dict[str, Vocabulary]:
    """The vocabularies of a training-set folder; {} for a set built before vocabularies (ids are rows)."""
    path = Path(folder) / VOCABULARY_FILE
    if not path.exists():
        return {}
    with np.load(path) as data:
        names = sorted({k.rsplit(".", 1)[0] for k in data.files})
        return {
            n: Vocabulary(n, data[f"{n}.ids"], data[f"{n}.rows"], int(data[f"{n}.buckets"])) for n in names
        }
