"""KServe's own Python client against the running server: ``kserve.InferenceRESTClient``, V1 and V2 (JSON and
binary tensors). The client always sends ``model_name`` in a V2 body; the ranking equals the plain V1 answer."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

from serving.client import post, v1_body
from tests.serving.world import MODEL, REQUEST_TS

pytestmark = pytest.mark.integration
CANDIDATES = [7, 3, 12, 40, 0]


def _call(protocol: str, server: str, data, model: str = MODEL):
    async def go():
        client = InferenceRESTClient(RESTConfig(protocol=protocol, retries=0, timeout=30))
        try:
            return await client.infer(server, data, model_name=model)
        finally:
            await client._client.aclose()  # (the client has no close of its own)

    return asyncio.run(go())


def _v2_request(binary: bool, model: str = MODEL) -> InferRequest:
    inputs = []
    for name, dtype, value in [("user_id", "INT64", np.array([1], np.int64)),
                               ("candidates", "INT64", np.array(CANDIDATES, np.int64)),
                               ("request_ts", "FP64", np.array([REQUEST_TS], np.float64)),
                               ("surface", "BYTES", np.array([b"feed"], np.object_))]:  # fmt: skip
        tensor = InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value, binary_data=binary)
        inputs.append(tensor)
    return InferRequest(model_name=model, infer_inputs=inputs, request_id=f"ks-{binary}")


@pytest.fixture(scope="module")
def v1_answer(server):
    body = v1_body(1, CANDIDATES, {"request_ts": float(REQUEST_TS), "surface": "feed"})
    return post(f"{server}/v1/models/{MODEL}:predict", body)[1]


def test_v1_predict(server, v1_answer):
    body = {"instances": [{"user_id": 1, "candidates": CANDIDATES,
                           "context": {"request_ts": float(REQUEST_TS), "surface": "feed"}}]}  # fmt: skip
    answer = _call("v1", server, body)["predictions"][0]
    assert answer["ad_ids"] == v1_answer["ad_ids"]
    np.testing.assert_allclose(answer["p_click"], v1_answer["p_click"], rtol=1e-6)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_v2_infer(server, v1_answer, binary):
    request = _v2_request(binary)
    assert request.to_rest()[0] is not None  # the body carries model_name: what the server used to refuse
    response = _call("v2", server, request)
    outputs = {o.name: o.as_numpy() for o in response.outputs}
    assert response.id == f"ks-{binary}" and response.model_name == MODEL
    np.testing.assert_array_equal(outputs["ad_ids"], v1_answer["ad_ids"])
    np.testing.assert_allclose(outputs["p_click"], v1_answer["p_click"], rtol=1e-6)


def test_v2_a_body_naming_another_model_is_a_400_naming_both(server):
    with pytest.raises(httpx.HTTPStatusError) as err:
        _call(
            "v2", server, _v2_request(False, model="other-ranker")
        )  # body says other-ranker, route says MODEL
    assert err.value.response.status_code == 400
    message = err.value.response.json()["error"]
    assert "'other-ranker'" in message and f"'{MODEL}'" in message
