"""Feast's serialized ``ValueProto`` and entity-key bytes, built vectorized from Arrow columns.

Feast converts every value to a protobuf object one at a time (tens of microseconds each); the online store only
keeps the serialized bytes. This module writes those bytes directly with numpy, for the types our views use:

    Value { int64 int64_val = 4; float float_val = 6; Int64List int64_list_val = 14; FloatList float_list_val = 16 }
    Int64List / FloatList { repeated <type> val = 1; }   (proto3: packed)

An input it cannot encode exactly like Feast (another type, a null, several join keys) raises
``UnsupportedForFastWrite``; callers then use Feast's own path. ``tests/features/test_encoding.py`` checks every
byte against ``ValueProto.SerializeToString`` and ``serialize_entity_key``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from feast.infra.key_encoding_utils import serialize_entity_key
from feast.protos.feast.types.EntityKey_pb2 import EntityKey as EntityKeyProto
from feast.protos.feast.types.Value_pb2 import Value as ValueProto
from feast.types import Array, Float32, Int64

# Field tags: (field number << 3) | wire type (0 varint, 2 length-delimited, 5 fixed32), as varint bytes.
INT64_VAL = b"\x20"  # 4 << 3 | 0
FLOAT_VAL = b"\x35"  # 6 << 3 | 5
INT64_LIST_VAL = b"\x72"  # 14 << 3 | 2
FLOAT_LIST_VAL = b"\x82\x01"  # 16 << 3 | 2 = 130, two varint bytes
PACKED_VAL = b"\x0a"  # field 1 of Int64List / FloatList, length-delimited (packed)

MAX_VARINT = 10  # a negative int64 takes ten 7-bit groups


class UnsupportedForFastWrite(ValueError):
    """The input needs a conversion this module does not reproduce; use Feast's own path."""


def varints(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 values -> (concatenated varint bytes, bytes per value); negatives as 10-byte two's complement."""
    u = np.ascontiguousarray(values, dtype=np.int64).view(np.uint64)
    # Only as many 7-bit groups as the largest value needs (ids and counts take 1-3, not 10).
    width = max(1, (int(u.max()).bit_length() + 6) // 7) if len(u) else 1
    if width <= 4:  # values below 2**28: half the memory traffic in uint32
        u = u.astype(np.uint32)
    shifts = np.arange(width, dtype=u.dtype) * u.dtype.type(7)
    groups = ((u[:, None] >> shifts) & u.dtype.type(0x7F)).astype(np.uint8)
    lengths = np.ones(len(u), np.int64)
    for k in range(1, width):
        lengths += (u >> u.dtype.type(7 * k)) != 0
    position = np.arange(width)
    groups |= (position < (lengths - 1)[:, None]).view(np.uint8) << 7  # continuation bit but on the last byte
    return groups[position < lengths[:, None]], lengths


def _constant(prefix: bytes, n: int, present: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The same bytes for each of ``n`` rows (only where ``present``)."""
    lengths = np.full(n, len(prefix), np.int64)
    if present is not None:
        lengths[~present] = 0
    flat = np.tile(np.frombuffer(prefix, np.uint8), int(lengths.astype(bool).sum()))
    return flat, lengths


def concat_rows(*streams: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise concatenation: row i of the result is row i of every stream, in order. Each stream is
    (concatenated bytes, bytes per row), rows stored back to back."""
    flats = [flat for flat, _ in streams]
    lengths = np.stack([length for _, length in streams], axis=1)  # (rows, streams)
    base = np.cumsum([0] + [len(f) for f in flats[:-1]])
    starts = np.stack(
        [
            b + np.concatenate([[0], np.cumsum(length)[:-1]])
            for b, (_, length) in zip(base, streams, strict=True)
        ],
        axis=1,
    )
    seg_len, seg_start = lengths.ravel(), starts.ravel()
    out_start = np.concatenate([[0], np.cumsum(seg_len)[:-1]])
    gather = np.repeat(seg_start - out_start, seg_len) + np.arange(int(seg_len.sum()))
    return np.concatenate(flats)[gather], lengths.sum(axis=1)


def split(flat: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """Back-to-back rows -> one ``bytes`` per row."""
    buf = flat.tobytes()
    ends = np.cumsum(lengths)
    return [buf[a:b] for a, b in zip((ends - lengths).tolist(), ends.tolist(), strict=True)]


def _no_nulls(column: pa.Array, name: str) -> None:
    if column.null_count:
        raise UnsupportedForFastWrite(f"column {name!r} has {column.null_count} null(s)")


def _list_parts(column: pa.Array, name: str) -> tuple[np.ndarray, pa.Array]:
    _no_nulls(column, name)
    offsets = column.offsets.to_numpy().astype(np.int64)
    flat = column.flatten()
    _no_nulls(flat, f"{name} (elements)")
    return offsets - offsets[0], flat


def _packed_list(tag: bytes, payload: tuple[np.ndarray, np.ndarray]) -> list[bytes]:
    """tag, len(inner), [0x0a, len(payload), payload] — the packed field is omitted for an empty list."""
    packed_len = payload[1]
    present = packed_len > 0
    len_bytes, len_lengths = varints(packed_len)
    len_bytes = len_bytes[np.repeat(present, len_lengths)]
    len_lengths = np.where(present, len_lengths, 0)
    inner_len = np.where(present, 1 + len_lengths + packed_len, 0)
    n = len(packed_len)
    return split(
        *concat_rows(
            _constant(tag, n),
            varints(inner_len),
            _constant(PACKED_VAL, n, present),
            (len_bytes, len_lengths),
            payload,
        )
    )


def encode_int64(column: pa.Array, name: str) -> list[bytes]:
    _no_nulls(column, name)
    values = column.to_numpy(zero_copy_only=False).astype(np.int64)
    return split(*concat_rows(_constant(INT64_VAL, len(values)), varints(values)))


def encode_float32(column: pa.Array, name: str) -> list[bytes]:
    _no_nulls(column, name)
    values = column.to_numpy(zero_copy_only=False).astype("<f4")
    rows = np.empty((len(values), 1 + 4), np.uint8)
    rows[:, 0] = FLOAT_VAL[0]
    rows[:, 1:] = values.view(np.uint8).reshape(-1, 4)
    return split(rows.ravel(), np.full(len(values), 5, np.int64))


def encode_int64_list(column: pa.Array, name: str) -> list[bytes]:
    offsets, flat = _list_parts(column, name)
    elem_bytes, elem_len = varints(flat.to_numpy(zero_copy_only=False).astype(np.int64))
    cum = np.concatenate([[0], np.cumsum(elem_len)])
    packed_len = cum[offsets[1:]] - cum[offsets[:-1]]
    return _packed_list(INT64_LIST_VAL, (elem_bytes, packed_len))


def encode_float32_list(column: pa.Array, name: str) -> list[bytes]:
    offsets, flat = _list_parts(column, name)
    payload = flat.to_numpy(zero_copy_only=False).astype("<f4").view(np.uint8)
    return _packed_list(FLOAT_LIST_VAL, (payload, 4 * np.diff(offsets)))


ENCODERS = {
    Int64: encode_int64,
    Float32: encode_float32,
    Array(Int64): encode_int64_list,
    Array(Float32): encode_float32_list,
}


def encode_values(column: pa.Array | pa.ChunkedArray, dtype, name: str) -> list[bytes]:
    """Serialized ``ValueProto`` per row, as Feast would write a value of Feast type ``dtype``."""
    encoder = ENCODERS.get(dtype)
    if encoder is None:
        raise UnsupportedForFastWrite(f"feature {name!r} has type {dtype}, not one of {list(ENCODERS)}")
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return encoder(column, name)


def value_texts(column: pa.Array | pa.ChunkedArray, dtype) -> list[str | None]:
    """The ``value_text`` Feast's SQLite store keeps beside each value: ``str`` of a scalar, None for a list."""
    if dtype == Int64:
        return list(map(str, column.to_numpy(zero_copy_only=False).astype(np.int64).tolist()))
    if dtype == Float32:
        # str() of the float32 widened to a Python float, as read back from ValueProto.float_val.
        return list(
            map(str, column.to_numpy(zero_copy_only=False).astype(np.float32).astype(np.float64).tolist())
        )
    return [None] * len(column)


def entity_keys(join_key: str, ids: np.ndarray, version: int) -> list[bytes]:
    """Feast's ``serialize_entity_key`` for one int64 join key, for every id: a fixed prefix + the id as <q."""
    zero = EntityKeyProto(join_keys=[join_key], entity_values=[ValueProto(int64_val=0)])
    template = serialize_entity_key(zero, entity_key_serialization_version=version)
    prefix, tail = template[:-8], template[-8:]
    if tail != bytes(8):
        raise UnsupportedForFastWrite(f"entity key layout v{version} does not end with the int64 id")
    ids = np.ascontiguousarray(ids, dtype="<i8")
    rows = np.empty((len(ids), len(prefix) + 8), np.uint8)
    rows[:, : len(prefix)] = np.frombuffer(prefix, np.uint8)
    rows[:, len(prefix) :] = ids.view(np.uint8).reshape(-1, 8)
    keys = split(rows.ravel(), np.full(len(ids), rows.shape[1], np.int64))
    if keys:  # one real key through Feast's own function: the layout assumption holds for this version
        first = EntityKeyProto(join_keys=[join_key], entity_values=[ValueProto(int64_val=int(ids[0]))])
        if serialize_entity_key(first, entity_key_serialization_version=version) != keys[0]:
            raise UnsupportedForFastWrite(f"entity key layout v{version} differs from Feast's")
    return keys
