"""Open Inference Protocol bodies without a server: strict decoding (JSON and binary) and the encoded answer."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from serving import v2
from serving.schema import RequestError, parse_request


def tensor(name, datatype, shape, data=None, **params):
    t = {"name": name, "datatype": datatype, "shape": shape}
    if data is not None:
        t["data"] = data
    if params:
        t["parameters"] = params
    return t


def user(uid=4, dtype="INT64"):
    return tensor("user_id", dtype, [1], [uid])


def binary(inputs: list[dict], tail: bytes, **extra) -> tuple[bytes, int]:
    head = orjson.dumps({"inputs": inputs, **extra})
    return head + tail, len(head)


def test_json_tensors_map_to_the_v1_request():
    req = v2.decode(orjson.dumps({"id": "r1", "inputs": [
        user(), tensor("candidates", "INT32", [1, 3], [[1, 2, 3]]), tensor("surface", "BYTES", [1], ["reels"]),
        tensor("request_ts", "FP64", [1], [1.5e9]), tensor("hour", "UINT8", [1, 1], [7]),
    ]}), None)  # fmt: skip
    parsed = parse_request(req.body, 10)
    assert parsed.user_id == 4 and parsed.candidates.tolist() == [1, 2, 3] and parsed.request_ts == 1.5e9
    assert parsed.surface == 2 and parsed.hour == 7 and req.request_id == "r1" and req.binary == set()


def test_binary_tensors_map_to_the_same_request():
    cands = np.array([9, 8, 7], "<i8")
    surface = len(b"feed").to_bytes(4, "little") + b"feed"
    raw, n = binary([tensor("user_id", "UINT32", [1], binary_data_size=4),
                     tensor("candidates", "INT64", [3], binary_data_size=24),
                     tensor("surface", "BYTES", [1], binary_data_size=len(surface))],
                    np.array([5], "<u4").tobytes() + cands.tobytes() + surface,
                    parameters={"binary_data_output": True})  # fmt: skip
    req = v2.decode(raw, v2.header_length(str(n).encode(), len(raw)))
    assert req.body == {"user_id": 5, "candidates": [9, 8, 7], "context": {"surface": "feed"}}
    assert req.binary == set(v2.OUTPUTS)


CASES = [
    ({"inputs": [user(), tensor("candidates", "INT64", [-3, -1], [1])]}, "negative dimension"),
    ({"inputs": [user(), tensor("candidates", "INT64", [], [1])]}, "shape must be a list of 1 or 2"),
    ({"inputs": [user(), tensor("candidates", "INT64", [2, 1], [1, 2])]}, "batch dimension 1"),
    ({"inputs": [user(), tensor("candidates", "UINT8", [1], [300])]}, "outside UINT8's range"),
    ({"inputs": [user(), tensor("candidates", "INT8", [1], [-129])]}, "outside INT8's range"),
    ({"inputs": [user(), tensor("candidates", "INT64", [1], [True])]}, "must be integers"),
    ({"inputs": [user(), tensor("candidates", "INT64", [1], [1.0])]}, "must be integers"),
    ({"inputs": [user(), tensor("candidates", "FP32", [1], [1.0])]}, "datatype 'FP32' is not allowed"),
    ({"inputs": [user(), tensor("candidates", "INT64", [3], [1, 2])]}, "holds 3 value(s) but data has 2"),
    ({"inputs": [tensor("user_id", "INT64", [2], [1, 2])]}, "exactly one value"),
    ({"inputs": [user(), user()]}, "given twice"),
    ({"inputs": [tensor("uid", "INT64", [1], [1])]}, "'uid' is not known"),
    ({"inputs": [user(), tensor("request_ts", "FP64", [1], ["x"])]}, "finite numbers"),
    ({"inputs": [user(), tensor("surface", "BYTES", [1], [3])]}, "must be strings"),
    ({"inputs": [{**user(), "extra": 1}]}, "unknown field(s) ['extra']"),
    ({"inputs": [user()], "batch": 1}, "unknown field(s) ['batch']"),
    ({"inputs": []}, "non-empty list"),
    ({"inputs": [user()], "id": 3}, "id must be a string"),
    ({"inputs": [user()], "outputs": [{"name": "scores"}]}, "each must name one of"),
    (
        {"inputs": [user()], "outputs": [{"name": "p_click", "parameters": {"binary_data": "yes"}}]},
        "true or false",
    ),
    ({"inputs": [tensor("user_id", "INT64", [1])]}, "data is missing"),
    ([1, 2], "must be a JSON object"),
    ({"inputs": [{**user(), "name": ["user_id"]}]}, "input ['user_id'] is not known"),
    ({"inputs": [{**user(), "name": {"a": 1}}]}, "is not known"),
    ({"inputs": [user()], "outputs": [{"name": ["p_click"]}]}, "each must name one of"),
    ({"inputs": [user()], "parameters": {"binary_data_output": {"a": [1]}}}, "boolean, number or string"),
    ({"inputs": [{**user(), "data": [[[[[[[[[1]]]]]]]]]}]}, "nests deeper than 8 levels"),
    ({"inputs": [user()], "id": [[[[[[[[[["x"]]]]]]]]]]}, "nests deeper than 8 levels"),
    (
        {"inputs": [user()], "model_name": "other"},
        "model_name 'other' in the body does not match the model 'gem-ranker'",
    ),
    ({"inputs": [user()], "model_name": ["gem-ranker"]}, "does not match"),
    ({"inputs": [user()], "x" * 5000: 1}, "unknown field(s) ['xxxxxxxxxxxx...xxxxxxxxxxxxx']"),
]


@pytest.mark.parametrize(("body", "needle"), CASES)
def test_json_mistakes_are_named(body, needle):
    with pytest.raises(RequestError) as err:
        v2.decode(orjson.dumps(body), None, "gem-ranker")
    assert needle in str(err.value) and len(str(err.value)) < 400


def test_a_message_never_recurses_into_a_deep_value():
    deep = b'{"inputs": [{"name": ' + b"[" * 1000 + b"]" * 1000 + b"}]}"  # under orjson's own limit of 1,024
    with pytest.raises(RequestError, match="nests deeper than 8 levels"):
        v2.decode(deep, None)


def test_model_name_in_the_body_is_accepted_when_it_names_the_route():
    req = v2.decode(orjson.dumps({"model_name": "gem-ranker", "inputs": [user()]}), None, "gem-ranker")
    assert req.body == {"user_id": 4}
    assert v2.decode(orjson.dumps({"model_name": "any", "inputs": [user()]}), None).body == {"user_id": 4}


@pytest.mark.parametrize(
    ("inputs", "tail", "needle"),
    [
        (
            [tensor("user_id", "INT64", [1], binary_data_size=7)],
            b"\0" * 7,
            "is not 1 INT64 value(s) of 8 byte(s)",
        ),
        (
            [tensor("user_id", "INT64", [1], binary_data_size=8)],
            b"\0" * 4,
            "within the 4 binary byte(s) left",
        ),
        ([tensor("user_id", "INT64", [1], binary_data_size=8)], b"\0" * 12, "4 byte(s) no input's"),
        ([tensor("user_id", "INT64", [1], binary_data_size=-1)], b"", "binary_data_size must be"),
        ([tensor("user_id", "INT64", [1], [1], binary_data_size=8)], b"\0" * 8, "either data or"),
        (
            [user(), tensor("request_ts", "FP64", [1], binary_data_size=8)],
            np.array([np.inf]).tobytes(),
            "finite",
        ),
        ([tensor("surface", "BYTES", [1], binary_data_size=6)], b"\x09\0\0\0ab", "runs past"),
    ],
)
def test_binary_mistakes_are_named(inputs, tail, needle):
    raw, n = binary(inputs, tail)
    with pytest.raises(RequestError) as err:
        v2.decode(raw, n)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "value",
    [
        b"abc",
        b"0",
        b"-4",
        b"999999",
        b"1e3",
        b"",
        "\u00b2".encode("latin-1"),
        "\u0661\u0662".encode(),
        "\uff11".encode(),
    ],
)
def test_header_length_must_be_a_count_inside_the_body(value):
    with pytest.raises(RequestError, match="Inference-Header-Content-Length"):
        v2.header_length(value, 100)


def test_encode_json_and_binary_outputs():
    arrays = {
        "ad_ids": np.array([3, 1]),
        "p_click": np.array([0.5, 0.25]),
        "p_conversion": np.array([0.1, 0.2]),
    }
    body, headers = v2.encode(v2.V2Request({}), "m", "v1", "rid", arrays, {"k": 1})
    out = orjson.loads(body)
    assert dict(headers)[b"content-type"] == b"application/json" and out["id"] == "rid"
    assert out["outputs"][0] == {"name": "ad_ids", "datatype": "INT64", "shape": [2], "data": [3, 1]}
    req = v2.V2Request({}, "mine", ["p_click", "ad_ids"], {"p_click"})
    body, headers = v2.encode(req, "m", "v1", "rid", arrays, {})
    n = int(dict(headers)[b"inference-header-content-length"])
    head = orjson.loads(body[:n])
    assert head["id"] == "mine" and [o["name"] for o in head["outputs"]] == ["p_click", "ad_ids"]
    assert head["outputs"][0]["parameters"] == {"binary_data_size": 8} and "data" not in head["outputs"][0]
    np.testing.assert_array_equal(np.frombuffer(body[n:], "<f4"), [0.5, 0.25])


def test_metadata_names_every_tensor():
    meta = v2.metadata("gem-ranker", "7")
    assert [t["name"] for t in meta["inputs"]] == list(v2.INPUTS)
    assert all(t["datatype"] and t["shape"] for t in meta["inputs"] + meta["outputs"])
