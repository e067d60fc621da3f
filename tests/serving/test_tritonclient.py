"""A third-party Open Inference Protocol client against the running server: tritonclient (HTTP), JSON and binary
tensors, the same ranking as the V1 answer; model metadata printed. These pin what tritonclient relies on of the
protocol that our own server (``serving.gateway``, ``serving.v2``) answers beside KServe (``serving.server``): health,
server and model metadata, readiness of a model that is not served, inference, statistics, errors."""

from __future__ import annotations

import json
import urllib.parse

import numpy as np
import pytest
import tritonclient.http as httpclient  # pinned in requirements/project.lock (a test dependency)

from serving.client import post, v1_body
from tests.serving.world import MODEL, REQUEST_TS

pytestmark = pytest.mark.integration
CANDIDATES = [7, 3, 12, 40, 0]


@pytest.fixture(scope="module")
def client(server):
    url = urllib.parse.urlsplit(server)
    c = httpclient.InferenceServerClient(url=f"{url.hostname}:{url.port}")
    yield c
    c.close()


def _inputs(binary: bool):
    tensors = []
    for name, dtype, value in [("user_id", "INT64", np.array([1], np.int64)),
                               ("candidates", "INT64", np.array(CANDIDATES, np.int64)),
                               ("request_ts", "FP64", np.array([REQUEST_TS], np.float64))]:  # fmt: skip
        t = httpclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value, binary_data=binary)
        tensors.append(t)
    surface = httpclient.InferInput("surface", [1], "BYTES")
    surface.set_data_from_numpy(np.array([b"feed"], dtype=np.object_), binary_data=binary)
    return [*tensors, surface]


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    meta = client.get_model_metadata(MODEL)
    print("model metadata:", json.dumps(meta))
    assert {t["name"]: t["datatype"] for t in meta["outputs"]} == {
        "ad_ids": "INT64", "p_click": "FP32", "p_conversion": "FP32"}  # fmt: skip
    assert [t["name"] for t in meta["inputs"]][:2] == ["user_id", "candidates"]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_round_trip_matches_v1(client, server, binary):
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("ad_ids", "p_click")]
    result = client.infer(MODEL, _inputs(binary), outputs=outputs, request_id=f"tc-{binary}")
    _, v1 = post(
        f"{server}/v1/models/{MODEL}:predict", v1_body(1, CANDIDATES, {"request_ts": float(REQUEST_TS)})
    )
    assert result.get_response()["id"] == f"tc-{binary}"
    np.testing.assert_array_equal(result.as_numpy("ad_ids"), v1["ad_ids"])
    np.testing.assert_allclose(result.as_numpy("p_click"), v1["p_click"], rtol=1e-6)
    assert result.as_numpy("p_conversion") is None  # not asked for


def test_infer_without_outputs_returns_all_in_binary(client):
    result = client.infer(MODEL, _inputs(True))  # tritonclient then asks for binary_data_output
    assert result.as_numpy("ad_ids").dtype == np.int64 and sorted(result.as_numpy("ad_ids")) == sorted(
        CANDIDATES
    )
    assert result.as_numpy("p_conversion").dtype == np.float32
    assert result.get_response()["parameters"]["fallback.degraded"] is False


def test_statistics_in_the_protocol_shape(client):
    stats = client.get_inference_statistics(MODEL)["model_stats"][0]
    assert stats["name"] == MODEL and stats["inference_count"] >= 1
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0


def test_a_client_mistake_is_an_inference_server_exception(client):
    from tritonclient.utils import InferenceServerException

    bad = httpclient.InferInput("candidates", [2], "UINT8")
    bad.set_data_from_numpy(np.array([1, 1], np.uint8), binary_data=True)
    with pytest.raises(InferenceServerException, match="duplicate ad id"):
        client.infer(MODEL, [_inputs(True)[0], bad])


def test_server_metadata_and_a_model_that_is_not_served(client):
    meta = client.get_server_metadata()
    assert meta["name"] and meta["version"] and isinstance(meta["extensions"], list)
    assert "model_repository_extension" not in meta["extensions"]  # off unless admin.repository_api is on
    assert client.is_model_ready(MODEL) and not client.is_model_ready("no-such-model")
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="not served here"):
        client.get_model_metadata("no-such-model")
