"""Fuzzing the running server over real HTTP: a generated table of malformed, hostile and odd requests, both
protocols. Whatever a client sends, the answer is never a 5xx, the connection is answered (no crash, no hang),
and the server is live and ready after every case."""

from __future__ import annotations

import http.client
import random
import urllib.parse
from collections import Counter

import orjson
import pytest

from tests.serving.world import MODEL, REQUEST_TS

pytestmark = pytest.mark.integration
V1, V2 = f"/v1/models/{MODEL}:predict", f"/v2/models/{MODEL}/infer"
WEIRD = [None, True, False, 0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 1.5, -0.0, 1e19, 1e300,
         -1e300, 5e-324, "", "1", "NaN", "inf", "feed", "\u0000", "é" * 50, [], [1], [[1]], {}, {"a": 1},
         list(range(60))]  # fmt: skip
DTYPES = ["INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64", "FP16", "FP32", "FP64",
          "BYTES", "BOOL", "int64", "", "STRING", None, 7]  # fmt: skip
SHAPES = [[1], [3], [1, 3], [], [-1], [-3, -1], [0], [2, 2], [1, 1, 1], [2**62], [1.5], ["1"], None, 1]
CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "text/plain",
                 "application/octet-stream", "multipart/form-data", "APPLICATION/JSON", "application/json;;"]  # fmt: skip
ENCODINGS = [None, None, None, "gzip", "deflate", "br", "identity", "x-unknown"]


def v1_case(rng: random.Random) -> tuple[str, bytes, dict]:
    body = {"user_id": rng.choice([0, 1, 5]), "candidates": [1, 2, 3],
            "context": {"request_ts": float(REQUEST_TS), "surface": "feed", "hour": 3}}  # fmt: skip
    for _ in range(rng.randint(1, 3)):
        where = rng.choice(
            ["user_id", "candidates", "context", "extra", "ctx_field", "cand_item", "instances"]
        )
        if not isinstance(body, dict) or "instances" in body:
            break  # already wrapped: the mutation is done
        if where == "ctx_field" and isinstance(body.get("context"), dict):
            body["context"][rng.choice(["request_ts", "surface", "hour", "device"])] = rng.choice(WEIRD)
        elif where == "cand_item" and isinstance(body.get("candidates"), list):
            body["candidates"] = [rng.choice(WEIRD), *body["candidates"]]
        elif where == "instances":
            body = {"instances": rng.choice([[body], [body, body], body, [], None])}
        elif where == "extra":
            body[rng.choice(["bid", "", "user", "candidates "])] = rng.choice(WEIRD)
        else:
            body[where] = rng.choice(WEIRD)
    raw = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS) if _dumpable(body) else b"{}"
    return V1, _mangle(rng, raw), {"Content-Type": "application/json"}


def v2_case(rng: random.Random) -> tuple[str, bytes, dict]:
    inputs = [
        {"name": "user_id", "shape": [1], "datatype": "INT64", "data": [rng.choice([0, 1, 5])]},
        {"name": "candidates", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]},
        {"name": "request_ts", "shape": [1], "datatype": "FP64", "data": [float(REQUEST_TS)]},
    ]
    for _ in range(rng.randint(1, 3)):
        t = rng.choice(inputs)
        key = rng.choice(["shape", "datatype", "data", "name", "parameters", "data_item", "drop"])
        if key == "shape":
            t["shape"] = rng.choice(SHAPES)
        elif key == "datatype":
            t["datatype"] = rng.choice(DTYPES)
        elif key == "data":
            t["data"] = rng.choice(WEIRD)
        elif key == "data_item" and isinstance(t.get("data"), list) and t["data"]:
            t["data"][0] = rng.choice(WEIRD)
        elif key == "name":
            t["name"] = rng.choice(["uid", "candidates", "surface", "hour", "", None, "user_id"])
        elif key == "parameters":
            t["parameters"] = rng.choice(
                [{"binary_data_size": rng.choice([-1, 0, 3, 7, 8, 10**9])}, "x", None]
            )
        else:
            t.pop(rng.choice(["shape", "datatype", "data", "name"]), None)
    body = {"inputs": inputs}
    if rng.random() < 0.2:
        body[rng.choice(["outputs", "parameters", "id", "batch"])] = rng.choice(
            [[{"name": "p_click", "parameters": {"binary_data": rng.choice([True, "no"])}}], {"binary_data_output": 1},
             "x", 3, [{"name": "scores"}]]
        )  # fmt: skip
    head = orjson.dumps(body) if _dumpable(body) else b"{}"
    headers: dict = {}
    if rng.random() < 0.3:  # the binary extension, with honest or broken lengths
        tail = rng.randbytes(rng.choice([0, 1, 7, 8, 24, 100]))
        length = rng.choice([str(len(head)), "abc", "-1", "0", str(len(head) + len(tail) + 1), "1e3", " 12"])
        headers["Inference-Header-Content-Length"] = length
        return V2, head + tail, headers
    return V2, _mangle(rng, head), headers


def _dumpable(body) -> bool:
    try:
        orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return False
    return True


def _mangle(rng: random.Random, raw: bytes) -> bytes:
    """Sometimes break the bytes themselves: truncate, flip a byte, duplicate, or send something else."""
    roll = rng.random()
    if roll < 0.08:
        return raw[: rng.randint(0, len(raw))]
    if roll < 0.14:
        i = rng.randrange(len(raw))
        return raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1 :]
    if roll < 0.17:
        return rng.choice([b"", b"null", b"[]", b"1e999", b"NaN", b'"x"', b"\xff\xfe", raw * 2, b"{" * 5000])
    return raw


def cases(n: int = 320, seed: int = 17) -> list[tuple[str, bytes, dict]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        path, body, headers = (v1_case if i % 2 == 0 else v2_case)(rng)
        if rng.random() < 0.15:  # header-level mistakes on top
            ctype, enc = rng.choice(CONTENT_TYPES), rng.choice(ENCODINGS)
            headers = {k: v for k, v in headers.items() if k != "Content-Type"}
            if ctype:
                headers["Content-Type"] = ctype
            if enc:
                headers["Content-Encoding"] = enc
        out.append((path, body, headers))
    return out


CASES = cases()


class Conn:
    """A keep-alive connection that reopens itself when the server closed it (after a 4xx with close)."""

    def __init__(self, base: str):
        url = urllib.parse.urlsplit(base)
        self.host, self.port, self.conn = url.hostname, url.port, None

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=15)
        try:
            self.conn.request(method, path, body=body, headers=headers or {})
            resp = self.conn.getresponse()
            payload = resp.read()
        except (http.client.HTTPException, OSError):
            self.conn.close()
            self.conn = None
            raise
        if resp.getheader("connection", "").lower() == "close":
            self.conn.close()
            self.conn = None
        return resp.status, payload


def test_the_table_is_big_and_covers_both_protocols():
    paths = Counter(p for p, _, _ in CASES)
    assert len(CASES) >= 200 and paths[V1] >= 100 and paths[V2] >= 100
    assert len({body for _, body, _ in CASES}) >= 200  # distinct bodies, not one case repeated


def test_no_input_gets_a_5xx_and_the_server_stays_healthy(server, server_log):
    client, probe = Conn(server), Conn(server)
    codes: Counter = Counter()
    for i, (path, body, headers) in enumerate(CASES):
        status, payload = client.request("POST", path, body, headers)
        codes[status] += 1
        assert status < 500, (i, path, body[:300], headers, status, payload[:300])
        if status >= 400:
            assert set(orjson.loads(payload)) == {"error"}, (i, payload[:300])  # the protocol's error shape
        assert probe.request("GET", "/v2/health/live")[0] == 200, i
        assert probe.request("GET", f"/v2/models/{MODEL}/ready")[0] == 200, i
    print(f"fuzz: {len(CASES)} cases, status counts {dict(sorted(codes.items()))}")
    assert sum(v for k, v in codes.items() if 400 <= k < 500) >= len(CASES) // 2  # most of it is a mistake
    assert "Traceback" not in server_log.read_text()  # 4xx log one line; nothing blew up inside
