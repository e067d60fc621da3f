"""Request validation without a server: every mistake is a RequestError naming the problem."""

from __future__ import annotations

import numpy as np
import pytest

from features.vocabulary import text_id
from serving.schema import RequestError, parse_request


def test_valid_request_parses_in_order():
    req = parse_request(
        {"user_id": 7, "candidates": [5, 3, 9], "context": {"surface": "reels", "hour": 3}}, 10
    )
    assert req.user_id == 7
    np.testing.assert_array_equal(req.candidates, [5, 3, 9])
    assert req.surface == 2 and req.hour == 3 and req.request_ts is None and not req.wrapped


def test_instances_wrapper_is_accepted_once():
    req = parse_request({"instances": [{"user_id": 1, "candidates": [2]}]}, 10)
    assert req.wrapped and req.user_id == 1


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"candidates": [1]}, "user_id: Field required"),
        ({"user_id": "", "candidates": [1]}, "user_id"),  # text ids are accepted (issue 34), empty ones not
        ({"user_id": 1.5, "candidates": [1]}, "user_id"),
        ({"user_id": True, "candidates": [1]}, "user_id"),
        ({"user_id": 1, "candidates": []}, "empty"),
        ({"user_id": 1, "candidates": list(range(11))}, "more than the limit of 10"),
        ({"user_id": 1, "candidates": [1, 2, 1]}, "duplicate ad id(s) [1]"),
        ({"user_id": 1, "candidates": [1, -2]}, "candidates[1]: Input should be greater than or equal to 0"),
        ({"user_id": 1, "candidates": [1], "context": {"request_ts": float("nan")}}, "finite"),
        ({"user_id": 1, "candidates": [1], "context": {"surface": "tv"}}, "'tv' is not one of"),
        ({"user_id": 1, "candidates": [1], "extra": 1}, "extra: Extra inputs are not permitted"),
        ([1, 2], "must be a JSON object"),
        ({"instances": [{"user_id": 1, "candidates": [1]}] * 2}, "exactly one"),
    ],
)
def test_mistakes_are_named(body, needle):
    with pytest.raises(RequestError) as err:
        parse_request(body, 10)
    assert needle in str(err.value)


@pytest.mark.parametrize("ts", [1e19, 1e300, float(2**63 - 1), 86400.0, 0.5, 2e9 + 1])
def test_request_ts_outside_the_window_is_refused(ts):
    body = {"user_id": 1, "candidates": [1], "context": {"request_ts": ts}}
    with pytest.raises(RequestError, match="outside the accepted window"):
        parse_request(body, 10, (1.7e9, 2e9))
    assert parse_request({**body, "context": {"request_ts": 1.8e9}}, 10, (1.7e9, 2e9)).request_ts == 1.8e9


def test_text_ids_are_the_callers_own_and_echoed():
    """Text ids (a shop's ``u_1832``, ``SKU-AB12``) become the raw int64 the importer stored; all-digit text is
    the integer itself; the answer echoes what was sent."""
    req = parse_request({"user_id": "u_1832", "candidates": ["SKU-AB12", 7, "42"]}, 10)
    assert req.user_id == text_id("u_1832") and req.user_key == "u_1832"
    assert req.candidates.tolist() == [text_id("SKU-AB12"), 7, 42]
    assert req.candidate_keys == ["SKU-AB12", 7, "42"]
    plain = parse_request({"user_id": 5, "candidates": [1, 2]}, 10)
    assert (
        plain.user_key is None and plain.candidate_keys is None
    )  # integer requests keep the numpy fast path
    with pytest.raises(RequestError, match="duplicate"):
        parse_request({"user_id": "u", "candidates": ["SKU-1", "SKU-1"]}, 10)
