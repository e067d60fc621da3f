"""Request validation without a server: every mistake is a RequestError naming the problem."""

from __future__ import annotations

import numpy as np
import pytest

from serving.schema import RequestError, parse_request, v2_to_body


class Tensor:
    def __init__(self, name, datatype, shape, data):
        self.name, self.datatype, self.shape, self.data = name, datatype, shape, data


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
        ({"user_id": "1", "candidates": [1]}, "user_id: Input should be a valid integer"),
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


def test_v2_tensors_map_to_the_same_request():
    body = v2_to_body(
        [
            Tensor("user_id", "INT64", [1], [4]),
            Tensor("candidates", "INT32", [1, 3], [[1, 2, 3]]),
            Tensor("surface", "BYTES", [1], ["feed"]),
            Tensor("request_ts", "FP64", [1], [1.5e9]),
        ]
    )
    req = parse_request(body, 10)
    assert req.user_id == 4 and req.candidates.tolist() == [1, 2, 3] and req.request_ts == 1.5e9


@pytest.mark.parametrize(
    ("tensors", "needle"),
    [
        ([Tensor("user", "INT64", [1], [1])], "input 'user' is not known"),
        ([Tensor("candidates", "FP32", [2], [1.0, 2.0])], "datatype FP32 is not allowed"),
        ([Tensor("candidates", "INT64", [3], [1, 2])], "shape [3] does not match its 2"),
        ([Tensor("user_id", "INT64", [2], [1, 2])], "exactly one value"),
        ([Tensor("user_id", "INT64", [1], [1]), Tensor("user_id", "INT64", [1], [1])], "given twice"),
    ],
)
def test_v2_mistakes_are_named(tensors, needle):
    with pytest.raises(RequestError) as err:
        v2_to_body(tensors)
    assert needle in str(err.value)
