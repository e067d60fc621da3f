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

# ----------------------------------------------------------------------------- hostile classes (issue 35)
# the three causes of the 500s found by hand, as they were sent
FOUND = [
    (V1, b'{"user_id": ' + b"[" * 1000 + b"]" * 1000 + b', "candidates": [1]}', {"Content-Type": "application/json"}),
    (V2, orjson.dumps({"inputs": [{"name": ["user_id"], "shape": [1], "datatype": "INT64", "data": [1]}]}), {}),
    (V2, orjson.dumps({"inputs": [{"name": "user_id", "shape": [1], "datatype": "INT64", "data": [1]}]}),
     {"Inference-Header-Content-Length": "\u00b2".encode("latin-1")}),
]  # fmt: skip
ODD_NAMES = [None, 1, 1.5, True, [], ["user_id"], {}, {"name": "user_id"}, [[["x"]]], {"a": {"b": []}}]
# digits str.isdigit() accepts and int() refuses or reads: superscripts, Arabic-Indic, fullwidth, Devanagari
UNICODE_DIGITS = [
    "\u00b2",
    "\u00b9\u00b2",
    "\u0661\u0662",
    "\uff11\uff12",
    "\u0967\u0968",
    "1\u00b2",
    "\u2460",
]


DEEP = "<deep>"  # stands for the nested value in a body; replaced after encoding (orjson stops at 254 levels)


def _nest(depth: int, leaf: bytes, rng: random.Random) -> bytes:
    opens = [rng.choice([b"[", b"[", b"[", b'{"a":']) for _ in range(depth)]  # (the test server takes 4 kB)
    closes = [b"]" if o == b"[" else b"}" for o in reversed(opens)]
    return b"".join(opens) + leaf + b"".join(closes)


def _v2_body() -> dict:
    return {"inputs": [{"name": "user_id", "shape": [1], "datatype": "INT64", "data": [1]},
                       {"name": "candidates", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]},
                       {"name": "request_ts", "shape": [1], "datatype": "FP64", "data": [float(REQUEST_TS)]}]}  # fmt: skip


def nesting_cases(rng: random.Random, n: int = 60) -> list[tuple[str, bytes, dict]]:
    """A value nested 7..1,020 deep (orjson's own limit is 1,024) at every place a request holds a value."""
    out = []
    for i in range(n):
        nested = _nest(
            rng.choice([7, 8, 9, 50, 500, 1000, 1020]), rng.choice([b"1", b'"x"', b"null", b"1.5"]), rng
        )
        deep = DEEP
        if i % 2 == 0:
            body = {"user_id": 1, "candidates": [1, 2, 3], "context": {"surface": "feed"}}
            where = rng.choice(
                ["user_id", "candidates", "cand_item", "context", "surface", "extra", "instances"]
            )
            if where == "cand_item":
                body["candidates"].append(deep)
            elif where == "surface":
                body["context"]["surface"] = deep
            elif where == "instances":
                body = {"instances": [body, deep]}
            else:
                body["bid" if where == "extra" else where] = deep
            out.append(
                (V1, orjson.dumps(body).replace(b'"<deep>"', nested), {"Content-Type": "application/json"})
            )
        else:
            body = _v2_body()
            tensor = rng.choice(body["inputs"])
            where = rng.choice(["name", "shape", "datatype", "data", "data_item", "parameters", "model_name", "id",
                                "outputs", "top_parameters", "inputs_item"])  # fmt: skip
            if where == "data_item":
                tensor["data"][0] = deep
            elif where == "inputs_item":
                body["inputs"].append(deep)
            elif where == "outputs":
                body["outputs"] = [{"name": deep}]
            elif where == "top_parameters":
                body["parameters"] = {"binary_data_output": deep}
            elif where in ("model_name", "id"):
                body[where] = deep
            else:
                tensor[where] = deep
            out.append((V2, orjson.dumps(body).replace(b'"<deep>"', nested), {}))
    return out


def odd_name_cases() -> list[tuple[str, bytes, dict]]:
    """Every place V2 takes a name, given something that is not a string (lists and objects are unhashable)."""
    out = []
    for odd in ODD_NAMES:
        for where in ("input", "output", "model_name", "id", "datatype", "surface"):
            if where == "id" and odd is None:
                continue  # a null id is no id (answered 200)
            body = _v2_body()
            if where == "input":
                body["inputs"][1]["name"] = odd
            elif where == "output":
                body["outputs"] = [{"name": "ad_ids"}, {"name": odd, "parameters": {"binary_data": True}}]
            elif where == "datatype":
                body["inputs"][0]["datatype"] = odd
            elif where == "surface":
                body["inputs"].append({"name": "surface", "shape": [1], "datatype": "BYTES", "data": [odd]})
            else:
                body[where] = odd
            out.append((V2, orjson.dumps(body), {}))
        v1 = {"user_id": 1, "candidates": [1, 2], "context": {"surface": odd}}
        out.append((V1, orjson.dumps(v1), {"Content-Type": "application/json"}))
    return out


def unicode_digit_cases() -> list[tuple[str, bytes, dict]]:
    """Unicode digits in every numeric header: Content-Length and Inference-Header-Content-Length."""
    out = []
    head = orjson.dumps(_v2_body())
    for digits in UNICODE_DIGITS:
        raw = digits.encode("utf-8")
        out.append((V2, head, {"Inference-Header-Content-Length": raw}))
        out.append((V2, head, {"Inference-Header-Content-Length": digits.encode("latin-1", "replace")}))
        out.append(
            (
                V1,
                b'{"user_id": 1, "candidates": [1]}',
                {"Content-Type": "application/json", "Content-Length": raw},
            )
        )
        out.append((V2, head, {"Content-Length": raw}))
    return out


HOSTILE = FOUND + nesting_cases(random.Random(35)) + odd_name_cases() + unicode_digit_cases()


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
    codes = _run(server, server_log, CASES)
    print(f"fuzz: {len(CASES)} cases, status counts {dict(sorted(codes.items()))}")
    assert sum(v for k, v in codes.items() if 400 <= k < 500) >= len(CASES) // 2  # most of it is a mistake


def test_hostile_classes_get_a_4xx_each(server, server_log):
    """Deep nesting, non-string names, Unicode digits in numeric headers: every one a 4xx in the error shape."""
    codes = _run(server, server_log, HOSTILE)
    print(f"fuzz, hostile classes: {len(HOSTILE)} cases, status counts {dict(sorted(codes.items()))}")
    assert len(HOSTILE) >= 150 and set(codes) <= set(range(400, 500)), codes


def _run(server: str, server_log, table: list) -> Counter:
    client, probe = Conn(server), Conn(server)
    codes: Counter = Counter()
    for i, (path, body, headers) in enumerate(table):
        status, payload = client.request("POST", path, body, headers)
        codes[status] += 1
        assert status < 500, (i, path, body[:300], headers, status, payload[:300])
        if status >= 400:
            assert set(orjson.loads(payload)) == {"error"}, (i, payload[:300])  # the protocol's error shape
        assert probe.request("GET", "/v2/health/live")[0] == 200, i
        assert probe.request("GET", f"/v2/models/{MODEL}/ready")[0] == 200, i
    assert "Traceback" not in server_log.read_text()  # 4xx log one line; nothing blew up inside
    return codes
