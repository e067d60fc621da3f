"""Raw ids -> model rows: frequency order, min_count, OOV, hashing, the size refusal, persistence."""

from __future__ import annotations

import numpy as np
import pytest

from features.vocabulary import (
    OOV,
    Vocabulary,
    VocabularyConfig,
    VocabularyError,
    load_vocabularies,
    raw_id,
    save_vocabularies,
    text_id,
)

HUGE = 9_207_439_375_053_591_776  # a hashed text id, as the manifest showed


def test_rows_follow_frequency_and_unknown_ids_are_oov():
    values = np.array([HUGE, 10**11, HUGE, 5, HUGE, 10**11])
    v = Vocabulary.build("ad_id", values, VocabularyConfig())
    assert v.size == 3
    rows, known = v.lookup(np.array([HUGE, 10**11, 5, 6, -3]))
    assert rows.tolist() == [0, 1, 2, OOV, OOV]  # most frequent first
    assert known.tolist() == [True, True, True, False, False]


def test_min_count_cuts_rare_ids_and_ties_are_deterministic():
    values = np.array([3, 3, 1, 1, 2])
    v = Vocabulary.build("user_id", values, VocabularyConfig(min_count=2))
    assert v.size == 2 and v.map(np.array([1, 3, 2])).tolist() == [0, 1, OOV]  # tie 1 vs 3: smaller id first


def test_a_huge_table_is_refused_with_the_key_to_use():
    with pytest.raises(
        VocabularyError, match=r"ad_id: 11 distinct ids exceed vocabulary.max_rows 10.*hash_buckets"
    ):
        Vocabulary.build("ad_id", np.arange(11), VocabularyConfig(max_rows=10))


def test_hash_buckets_bound_the_table_and_map_unseen_ids_too():
    v = Vocabulary.build("ad_id", np.arange(1000) * 10**9, VocabularyConfig(hash_buckets=64))
    rows, known = v.lookup(np.array([0, 10**9, 123]))
    assert v.size == 64 and ((rows >= 0) & (rows < 64)).all()
    assert known.tolist() == [True, True, False]
    spread = np.bincount(v.map(np.arange(1000) * 10**9), minlength=64)
    assert spread.max() < 40  # strided integer ids spread over the buckets instead of piling into one


def test_save_and_load_round_trip(tmp_path):
    vocabularies = {
        "ad_id": Vocabulary.build("ad_id", np.array([7, 7, HUGE]), VocabularyConfig()),
        "user_id": Vocabulary.build("user_id", np.array([1, 2]), VocabularyConfig(hash_buckets=8)),
    }
    save_vocabularies(vocabularies, tmp_path)
    back = load_vocabularies(tmp_path)
    assert back["ad_id"].map(np.array([HUGE, 7, 3])).tolist() == [1, 0, OOV]
    assert back["user_id"].buckets == 8
    assert load_vocabularies(tmp_path / "nothing") == {}


def test_raw_id_matches_the_importer():
    assert raw_id("u_1832") == text_id("u_1832") and raw_id("u_1832") != raw_id("u_1833")
    assert raw_id(42) == 42 and raw_id("42") == 42
    for bad in ("", -1, True):
        with pytest.raises(ValueError):
            raw_id(bad)
