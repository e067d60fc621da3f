"""Open Inference Protocol (V2) bodies of the ranker, decoded and encoded strictly, JSON and binary extension.

A request is ``{"id"?, "parameters"?, "inputs": [...], "outputs"?: [...]}``; with the binary extension the
``Inference-Header-Content-Length`` header says how many leading bytes are that JSON and each input with
``parameters.binary_data_size`` takes its bytes, in order, from what follows. Every tensor is checked exactly:
known name, allowed datatype, a shape of one or two non-negative dimensions whose product is the element count,
each value of the datatype's kind and range (UINT8 300 is a mistake, not 44), finite floats, binary sizes a
multiple of the element size that use up the binary section exactly. The result is the V1-shaped body that
``serving.schema.parse_request`` checks for meaning (ids >= 0, no duplicates, ...).

Outputs go back as JSON ``data`` or, when the request asks (``outputs[].parameters.binary_data`` or
``parameters.binary_data_output``, as tritonclient does), as raw little-endian bytes after the JSON header.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from serving.schema import RequestError, check_depth, short

DTYPES = {
    "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
    "UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "FP32": "<f4", "FP64": "<f8",
}  # fmt: skip
INTS = tuple(k for k in DTYPES if "INT" in k)
FLOATS = ("FP32", "FP64")
RANGES = {k: (int(np.iinfo(DTYPES[k]).min), int(np.iinfo(DTYPES[k]).max)) for k in INTS}
# input name -> allowed datatypes, and whether it holds one value (shape [1] or [1, 1])
INPUTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "user_id": (INTS + ("BYTES",), True),  # BYTES: the caller's own text ids
    "candidates": (INTS + ("BYTES",), False),
    "surface": (("BYTES",), True),
    "hour": (INTS, True),
    "request_ts": (INTS + FLOATS, True),
    "retrieve_k": (INTS, True),  # without candidates: the server retrieves this many (``serving.retrieval``)
    "exclude_advertisers": (INTS, False),
}
OUTPUTS = {"ad_ids": "INT64", "p_click": "FP32", "p_conversion": "FP32"}
CONTEXT_INPUTS = ("surface", "hour", "request_ts")
RETRIEVE_INPUTS = {"retrieve_k": "k", "exclude_advertisers": "exclude_advertisers"}
# model_name: KServe's InferenceRESTClient always sends it; accepted when it names the route's model
REQUEST_KEYS = {"id", "model_name", "parameters", "inputs", "outputs"}
INPUT_KEYS = {"name", "shape", "datatype", "data", "parameters"}
OUTPUT_KEYS = {"name", "parameters"}


@dataclass
class V2Request:
    body: dict  # the V1-shaped ranking request
    request_id: str | None = None
    outputs: list[str] = field(default_factory=lambda: list(OUTPUTS))  # in the order asked for
    binary: set[str] = field(default_factory=set)  # outputs to send in the binary extension


def header_length(value: bytes | None, body_size: int) -> int | None:
    """The ``Inference-Header-Content-Length`` header as a JSON length within the body, or None if absent."""
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    # isdigit() alone admits Unicode digits ('²', Arabic-Indic) that int() refuses or reads differently
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= body_size:
        raise RequestError(
            f"Inference-Header-Content-Length must be a byte count in 1..{body_size} (the body's size), "
            f"got {text[:20]!r}"
        )
    return int(text)


def decode(raw: bytes, json_length: int | None, model_name: str | None = None) -> V2Request:
    """``model_name``: the model the route names; a ``model_name`` in the body must equal it (None: any string)."""
    head, binary = (raw, b"") if json_length is None else (raw[:json_length], raw[json_length:])
    try:
        req = orjson.loads(head)
    except orjson.JSONDecodeError as err:
        raise RequestError(f"the body is not valid JSON: {err}") from None
    if not isinstance(req, dict):
        raise RequestError(f"the inference request must be a JSON object, got {type(req).__name__}")
    try:
        return _request(req, binary, model_name)
    except RequestError:
        check_depth(req, "the inference request")  # a deep body is named as such (a valid one skips the walk)
        raise


def _request(req: dict, binary: bytes, model_name: str | None) -> V2Request:
    _keys(req, REQUEST_KEYS, "the inference request")
    named = req.get("model_name", model_name)
    if "model_name" in req and (type(named) is not str or model_name not in (None, named)):
        raise RequestError(
            f"model_name {short(named)} in the body does not match the model {short(model_name)} of the route"
        )
    request_id = req.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise RequestError("id must be a string")
    params = _object(req.get("parameters"), "parameters")
    binary_all = _flag(params.get("binary_data_output"), "parameters.binary_data_output")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("inputs must be a non-empty list of tensors")
    if len(inputs) > len(INPUTS):
        raise RequestError(f"at most {len(INPUTS)} inputs are known, got {len(inputs)}")
    values: dict[str, Any] = {}
    rest = memoryview(binary)
    for tensor in inputs:
        name, value, rest = _input(tensor, rest)
        if name in values:
            raise RequestError(f"input {name!r} is given twice")
        values[name] = value
    if len(rest):
        raise RequestError(
            f"the binary section has {len(rest)} byte(s) no input's binary_data_size accounts for"
        )
    out = V2Request(_body(values), request_id)
    if binary_all:
        out.binary = set(OUTPUTS)
    if req.get("outputs") is not None:
        out.outputs, out.binary = _requested(req["outputs"], binary_all)
    return out


def _keys(obj: dict, allowed: set[str], what: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        names = [short(k) for k in extra[:5]]  # a key can be any length
        raise RequestError(f"{what}: unknown field(s) [{', '.join(names)}]; allowed: {sorted(allowed)}")


def _object(value: Any, what: str) -> dict:
    """A ``parameters`` object: the protocol's parameter values are booleans, numbers or strings."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RequestError(f"{what} must be a JSON object")
    if not _SCALARS.issuperset(map(type, value.values())):
        raise RequestError(f"{what}: every value must be a boolean, number or string")
    return value


_SCALARS = frozenset((bool, int, float, str))


def _flag(value: Any, what: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{what} must be true or false")
    return value


def _input(tensor: Any, binary: memoryview) -> tuple[str, Any, memoryview]:
    if not isinstance(tensor, dict):
        raise RequestError("every input must be a JSON object with name, shape, datatype and data")
    name = tensor.get("name")
    if type(name) is not str or name not in INPUTS:  # (a list or object name is unhashable)
        raise RequestError(f"input {short(name)} is not known; expected some of {sorted(INPUTS)}")
    _keys(tensor, INPUT_KEYS, f"input {name!r}")
    allowed, single = INPUTS[name]
    dtype = tensor.get("datatype")
    if dtype not in allowed:
        raise RequestError(
            f"input {name!r}: datatype {short(dtype)} is not allowed; use one of {list(allowed)}"
        )
    count = _shape(name, tensor.get("shape"), single)
    params = _object(tensor.get("parameters"), f"input {name!r} parameters")
    if "binary_data_size" in params:
        if "data" in tensor:
            raise RequestError(f"input {name!r}: give either data or parameters.binary_data_size, not both")
        size = params["binary_data_size"]
        if type(size) is not int or not 0 <= size <= len(binary):
            raise RequestError(
                f"input {name!r}: binary_data_size must be a byte count within the {len(binary)} binary byte(s) left"
            )
        flat = _from_bytes(name, dtype, binary[:size], count)
        binary = binary[size:]
    else:
        if "data" not in tensor:
            raise RequestError(f"input {name!r}: data is missing")
        flat = _from_json(name, dtype, tensor["data"], count)
    return name, (flat[0] if single else flat), binary


def _shape(name: str, shape: Any, single: bool) -> int:
    if not isinstance(shape, list) or not 1 <= len(shape) <= 2 or any(type(d) is not int for d in shape):
        raise RequestError(f"input {name!r}: shape must be a list of 1 or 2 integers, got {short(shape)}")
    if any(d < 0 for d in shape):
        raise RequestError(f"input {name!r}: shape {shape} has a negative dimension")
    if len(shape) == 2 and shape[0] != 1:
        raise RequestError(
            f"input {name!r}: shape {shape}: one request ranks for one user (batch dimension 1)"
        )
    count = shape[-1]
    if single and count != 1:
        raise RequestError(f"input {name!r} must hold exactly one value (shape [1]), got shape {shape}")
    return count


def _from_json(name: str, dtype: str, data: Any, count: int) -> list:
    if not isinstance(data, list):
        raise RequestError(f"input {name!r}: data must be a list")
    if data and isinstance(data[0], list):  # row-major nesting of a [1, N] shape
        if len(data) != 1 or not isinstance(data[0], list):
            raise RequestError(f"input {name!r}: data nests more rows than its shape has")
        data = data[0]
    if len(data) != count:
        raise RequestError(f"input {name!r}: shape holds {count} value(s) but data has {len(data)}")
    if dtype == "BYTES":
        if not all(type(v) is str for v in data):
            raise RequestError(f"input {name!r}: BYTES data must be strings")
    elif dtype in INTS:
        if not all(type(v) is int for v in data):
            raise RequestError(
                f"input {name!r}: {dtype} data must be integers (no floats, booleans or strings)"
            )
        lo, hi = RANGES[dtype]
        if data and (min(data) < lo or max(data) > hi):
            raise RequestError(f"input {name!r}: a value is outside {dtype}'s range {lo}..{hi}")
    else:
        if not all(type(v) in (int, float) and math.isfinite(v) for v in data):
            raise RequestError(f"input {name!r}: {dtype} data must be finite numbers")
    return data


def _from_bytes(name: str, dtype: str, raw: memoryview, count: int) -> list:
    if dtype == "BYTES":
        return _strings(name, bytes(raw), count)
    item = np.dtype(DTYPES[dtype]).itemsize
    if len(raw) != count * item:
        raise RequestError(
            f"input {name!r}: binary_data_size {len(raw)} is not {count} {dtype} value(s) of {item} byte(s)"
        )
    arr = np.frombuffer(raw, DTYPES[dtype])
    if dtype in FLOATS and not np.isfinite(arr).all():
        raise RequestError(f"input {name!r}: {dtype} data must be finite numbers")
    return arr.tolist()


def _strings(name: str, raw: bytes, count: int) -> list[str]:
    """The binary BYTES layout: each element is a 4-byte little-endian length, then that many bytes."""
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(raw):
            raise RequestError(f"input {name!r}: the binary BYTES data ends inside an element's length")
        size = int.from_bytes(raw[pos : pos + 4], "little")
        if pos + 4 + size > len(raw):
            raise RequestError(f"input {name!r}: a binary BYTES element runs past binary_data_size")
        try:
            out.append(raw[pos + 4 : pos + 4 + size].decode())
        except UnicodeDecodeError:
            raise RequestError(f"input {name!r}: BYTES data must be UTF-8 text") from None
        pos += 4 + size
    if pos != len(raw):
        raise RequestError(f"input {name!r}: binary_data_size has {len(raw) - pos} byte(s) past its elements")
    return out


def _body(values: dict[str, Any]) -> dict:
    body = {k: values[k] for k in ("user_id", "candidates") if k in values}
    context = {k: values[k] for k in CONTEXT_INPUTS if k in values}
    if "request_ts" in context:
        context["request_ts"] = float(context["request_ts"])
    if context:
        body["context"] = context
    retrieve = {field: values[name] for name, field in RETRIEVE_INPUTS.items() if name in values}
    if retrieve:  # the server retrieves the candidates (refused by the schema if candidates came too)
        body["retrieve"] = retrieve
    return body


def _requested(outputs: Any, binary_all: bool) -> tuple[list[str], set[str]]:
    if not isinstance(outputs, list) or not outputs:
        raise RequestError("outputs must be a non-empty list of {name, parameters?}")
    names, binary = [], set()
    for out in outputs:
        if not isinstance(out, dict) or type(out.get("name")) is not str or out["name"] not in OUTPUTS:
            raise RequestError(f"outputs: each must name one of {list(OUTPUTS)}")
        _keys(out, OUTPUT_KEYS, f"output {out['name']!r}")
        if out["name"] in names:
            raise RequestError(f"output {out['name']!r} is asked for twice")
        names.append(out["name"])
        flag = _object(out.get("parameters"), f"output {out['name']!r} parameters").get("binary_data")
        if _flag(flag, f"output {out['name']!r} parameters.binary_data") or (flag is None and binary_all):
            binary.add(out["name"])
    return names, binary


# ------------------------------------------------------------------------------------------- responses
def encode(
    req: V2Request, model_name: str, model_version: str, request_id: str, arrays: dict[str, np.ndarray],
    parameters: dict,
) -> tuple[bytes, list[tuple[bytes, bytes]]]:  # fmt: skip
    """(body, extra headers) of the response: JSON, or JSON header + raw outputs when any output is binary."""
    outputs, tail = [], []
    for name in req.outputs:
        if isinstance(arrays[name], list):  # text ids, echoed as the caller sent them
            tensor, raw = (
                {"name": name, "datatype": "BYTES", "shape": [len(arrays[name])]},
                _bytes(arrays[name]),
            )
            if name in req.binary:
                tensor["parameters"] = {"binary_data_size": len(raw)}
                tail.append(raw)
            else:
                tensor["data"] = [str(v) for v in arrays[name]]
            outputs.append(tensor)
            continue
        arr = np.ascontiguousarray(arrays[name], dtype=DTYPES[OUTPUTS[name]])
        tensor = {"name": name, "datatype": OUTPUTS[name], "shape": [len(arr)]}
        if name in req.binary:
            raw = arr.tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            tail.append(raw)
        else:
            tensor["data"] = arr
        outputs.append(tensor)
    payload = {
        "model_name": model_name,
        "model_version": model_version,
        "id": req.request_id or request_id,
        "parameters": parameters,
        "outputs": outputs,
    }
    head = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    if not tail:
        return head, [(b"content-type", b"application/json")]
    headers = [
        (b"content-type", b"application/octet-stream"),
        (b"inference-header-content-length", str(len(head)).encode()),
    ]
    return head + b"".join(tail), headers


def _bytes(values: list) -> bytes:
    """The binary BYTES layout of ``values`` (each: 4-byte little-endian length, then its UTF-8 text)."""
    parts = [str(v).encode() for v in values]
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def metadata(model_name: str, model_version: str) -> dict:
    """The model-metadata answer (``GET /v2/models/{name}``): every input and output with datatype and shape."""
    preferred = {"surface": "BYTES", "request_ts": "FP64"}  # request_ts: epoch seconds; ids: INT64
    inputs = [
        {"name": name, "datatype": preferred.get(name, "INT64"), "shape": [1] if single else [-1],
         "parameters": {"accepted_datatypes": ",".join(dtypes), "optional": name in CONTEXT_INPUTS or name in RETRIEVE_INPUTS}}
        for name, (dtypes, single) in INPUTS.items()
    ]  # fmt: skip
    outputs = [{"name": n, "datatype": d, "shape": [-1]} for n, d in OUTPUTS.items()]
    return {"name": model_name, "versions": [model_version], "platform": "gemflow-ranker",
            "inputs": inputs, "outputs": outputs}  # fmt: skip
