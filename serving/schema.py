"""The ranking request: what a client may send, validated strictly, every problem named in the error.

    {"user_id": 42, "candidates": [7, 19, 3], "context": {"surface": "feed", "hour": 13, "request_ts": 1.7e9}}

Without ``candidates``, ``"retrieve": {"k": 1000, "exclude_advertisers": [3]}`` (both optional: ``{}`` takes
the server's default K) asks the server to retrieve them (``serving.retrieval``) and rank those.
V1 accepts that object as the body (or wrapped as ``{"instances": [<it>]}``); V2 / Open Inference Protocol
sends the same fields as named tensors (``serving.v2``). Ids are integers or text (the caller's own
ids, echoed back as sent). Strict types: no strings for numbers, no floats or
booleans for ids, no NaN/inf, no unknown fields, no duplicate or negative ids, and a ``request_ts`` inside the
window the server allows around its clock (``ts_bounds``).
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from features.schema import SURFACES
from features.vocabulary import raw_id

INT64_MAX = 2**63 - 1
Id = Annotated[int, Field(ge=0, le=INT64_MAX)]
# The caller's own id: an integer, or text (hashed as the importer hashes it, ``features.vocabulary.raw_id``).
AnyId = Id | Annotated[str, Field(min_length=1, max_length=256)]
V2_INT = ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
V2_FLOAT = ("FP32", "FP64")
# the deepest a request nests (V2: body > inputs > tensor > data > row is 5): a rejected body deeper than this is
# named as such before any message quotes it; and quoting (``short``) never recurses past two levels anyway
MAX_DEPTH = 8
_CONTAINERS = (dict, list)
# quotes a client value in an error message: bounded in depth, items and length whatever the value is
_QUOTE = reprlib.Repr()  # (keyword arguments need Python 3.12)
_QUOTE.maxlevel = 2  # deeper containers are shown as [...] / {...}
_QUOTE.maxlist = _QUOTE.maxdict = 4
_QUOTE.maxstring = _QUOTE.maxother = _QUOTE.maxlong = 30


class RequestError(ValueError):
    """A client mistake: answered 4xx with this message."""


class RankContext(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    surface: str = "feed"
    hour: Annotated[int, Field(ge=0, le=23)] | None = None
    request_ts: Annotated[float, Field(gt=0)] | None = None  # epoch seconds; default: the server's clock


class RetrieveSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    k: int | None = None  # None: the server's default
    exclude_advertisers: list[Id] = Field(default_factory=list, max_length=10_000)


class RankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    user_id: AnyId
    candidates: list[AnyId] | None = None  # None: ``retrieve`` them
    retrieve: RetrieveSpec | None = None
    context: RankContext = Field(default_factory=RankContext)


@dataclass
class ParsedRequest:
    user_id: int
    candidates: np.ndarray  # (N,) int64, in request order, unique
    surface: int  # SURFACES id
    hour: int | None
    request_ts: float | None
    wrapped: bool  # V1 ``instances`` form: answer as ``predictions``
    user_key: str | None = None  # the user id as sent, when it was text (``user_id`` is its raw int64)
    candidate_keys: list | None = None  # the candidates as sent, when any was text (answers echo them)
    retrieve_k: int | None = None  # set: the server retrieves this many candidates (``candidates`` is empty)
    exclude_advertisers: tuple[int, ...] = ()


UNION_BRANCHES = {"constrained-int": int, "constrained-str": str}  # an id's two types (``AnyId``)


def _errors(err: ValidationError) -> list[dict]:
    """One error per field: of an id's two union branches, the one matching what was sent (text or not)."""
    out: dict[tuple, dict] = {}
    for e in err.errors():
        branch = UNION_BRANCHES.get(e["loc"][-1]) if e["loc"] else None
        loc = e["loc"][:-1] if branch else e["loc"]
        if branch is not None and (branch is str) != isinstance(e.get("input"), str):
            out.setdefault(loc, {**e, "loc": loc})
            continue
        out[loc] = {**e, "loc": loc}
    return list(out.values())


def _describe(err: ValidationError) -> str:
    parts = []
    errors = _errors(err)
    for e in errors[:5]:
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".") or "body"
        got = e.get("input")
        shown = "" if e["type"] in ("missing", "extra_forbidden") else f" (got {short(got)})"
        parts.append(f"{loc}: {e['msg']}{shown}")
    more = len(errors) - len(parts)
    return "; ".join(parts) + (f"; and {more} more problem(s)" if more > 0 else "")


def short(value: Any) -> str:
    """A client value quoted in an error message: never recursive past two levels, never long."""
    text = _QUOTE.repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_depth(value: Any, what: str = "the body") -> None:
    """RequestError when ``value`` (decoded JSON) nests deeper than MAX_DEPTH. Iterative, and a list of scalars
    costs one C-level pass (``map(type, ...)``), so the 1,000 candidates of a normal request stay cheap."""
    level, todo = 1, [value]
    while todo:
        nested = []
        for v in todo:
            kind = type(v)
            if kind is dict:
                items = v.values()
            elif kind is list:
                items = v
            else:
                continue
            kinds = set(map(type, items))
            if dict not in kinds and list not in kinds:
                continue
            nested.extend(x for x in items if type(x) in _CONTAINERS)
        if nested and level >= MAX_DEPTH:
            raise RequestError(f"{what} nests deeper than {MAX_DEPTH} levels of arrays and objects")
        level, todo = level + 1, nested


def parse_request(
    body: Any,
    max_candidates: int,
    ts_bounds: tuple[float, float] | None = None,
    retrieve_k: tuple[int, int] | None = None,
) -> ParsedRequest:
    """A V1 body (already JSON-decoded) -> ParsedRequest, or RequestError naming what is wrong.

    ``ts_bounds``: the oldest and newest ``context.request_ts`` accepted (epoch seconds), None = no bound.
    ``retrieve_k``: (default, largest) K of a request without candidates; None = this server does not retrieve."""
    wrapped = False
    if isinstance(body, dict) and "instances" in body:
        if set(body) != {"instances"}:
            raise RequestError(f"with 'instances', no other top-level field is allowed; got {sorted(body)}")
        instances = body["instances"]
        if not isinstance(instances, list) or len(instances) != 1:
            raise RequestError("'instances' must be a list holding exactly one ranking request")
        body, wrapped = instances[0], True
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        req = RankRequest.model_validate(body)
    except ValidationError as err:
        check_depth(body)  # before any message quotes the input (a valid request never pays for the walk)
        raise RequestError(f"invalid request: {_describe(err)}") from None
    if req.candidates is None:
        return _check_retrieve(req, wrapped, ts_bounds, retrieve_k)
    if req.retrieve is not None:
        raise RequestError("send either candidates or retrieve, not both")
    return _check(req, max_candidates, wrapped, ts_bounds)


def _check_retrieve(
    req: RankRequest, wrapped: bool, ts_bounds: tuple[float, float] | None, limits: tuple[int, int] | None
) -> ParsedRequest:
    if req.retrieve is None:
        raise RequestError(
            'candidates: Field required (or send "retrieve": {} to have the server retrieve the candidates)'
        )
    if limits is None:
        raise RequestError(
            "retrieve: this server does not retrieve candidates (retrieval.enabled is off); send candidates"
        )
    default, largest = limits
    k = default if req.retrieve.k is None else req.retrieve.k
    if not 1 <= k <= largest:
        raise RequestError(f"retrieve.k: {k} must be within 1..{largest}")
    empty = req.model_copy(update={"candidates": [0]})  # the context checks, on a placeholder candidate
    parsed = _check(empty, 1, wrapped, ts_bounds)
    parsed.candidates = np.zeros(0, np.int64)
    parsed.retrieve_k = k
    parsed.exclude_advertisers = tuple(req.retrieve.exclude_advertisers)
    return parsed


def _check(
    req: RankRequest, max_candidates: int, wrapped: bool, ts_bounds: tuple[float, float] | None
) -> ParsedRequest:
    n = len(req.candidates)
    if n == 0:
        raise RequestError("candidates: the list is empty (send 1 or more ad ids)")
    if n > max_candidates:
        raise RequestError(f"candidates: {n} ad ids is more than the limit of {max_candidates}")
    keys = req.candidates if any(type(c) is str for c in req.candidates) else None
    cands = np.asarray(req.candidates if keys is None else [raw_id(c) for c in keys], dtype=np.int64)
    ordered = np.sort(cands)
    if (ordered[1:] == ordered[:-1]).any():  # (a sort and one compare: half of np.unique's time)
        dup = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])[:5].tolist()
        raise RequestError(f"candidates: duplicate ad id(s) {dup}; each candidate must appear once")
    ctx = req.context
    if ctx.surface not in SURFACES:
        raise RequestError(f"context.surface: {ctx.surface!r} is not one of {list(SURFACES)}")
    ts = ctx.request_ts
    if ts is not None and ts_bounds is not None and not ts_bounds[0] <= ts <= ts_bounds[1]:
        raise RequestError(
            f"context.request_ts: {ts:.6g} is outside the accepted window {ts_bounds[0]:.0f}..{ts_bounds[1]:.0f} "
            "(epoch seconds around the server clock; omit it to use the server's clock)"
        )
    return ParsedRequest(
        user_id=raw_id(req.user_id),
        candidates=cands,
        surface=SURFACES.index(ctx.surface),
        hour=ctx.hour,
        request_ts=ctx.request_ts,
        wrapped=wrapped,
        user_key=req.user_id if type(req.user_id) is str else None,
        candidate_keys=keys,
    )
