"""The vectorized encoder writes exactly the bytes of Feast's protobuf values and entity keys."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from feast.infra.key_encoding_utils import serialize_entity_key
from feast.protos.feast.types.EntityKey_pb2 import EntityKey
from feast.protos.feast.types.Value_pb2 import Value
from feast.type_map import python_values_to_proto_values
from feast.types import Array, Float32, Int64, String
from feast.value_type import ValueType
from hypothesis import given, settings
from hypothesis import strategies as st

from features.feature_repo.encoding import (
    UnsupportedForFastWrite,
    encode_values,
    entity_keys,
    value_texts,
)

INT64 = st.integers(-(2**63), 2**63 - 1)
SMALL = st.integers(0, 2**28)  # the uint32 fast path
FLOAT32 = st.floats(width=32, allow_nan=False)


def feast_bytes(values, value_type: ValueType) -> list[bytes]:
    """What Feast's own conversion (used by materialize and push) serializes."""
    return [v.SerializeToString() for v in python_values_to_proto_values(values, value_type)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(INT64, SMALL), min_size=1, max_size=50))
def test_int64_scalars(values):
    column = pa.array(values, pa.int64())
    assert encode_values(column, Int64, "x") == feast_bytes(np.array(values, np.int64), ValueType.INT64)
    assert value_texts(column, Int64) == [str(v) for v in values]


@settings(max_examples=60, deadline=None)
@given(st.lists(FLOAT32, min_size=1, max_size=50))
def test_float32_scalars(values):
    column = pa.array(values, pa.float32())
    expected = feast_bytes(np.array(values, np.float32), ValueType.FLOAT)
    assert encode_values(column, Float32, "x") == expected
    assert value_texts(column, Float32) == [str(Value.FromString(b).float_val) for b in expected]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.one_of(INT64, SMALL), max_size=70), min_size=1, max_size=20), st.integers(0, 3))
def test_int64_lists_including_empty_and_sliced(lists, cut):
    column = pa.array(lists, pa.list_(pa.int64())).slice(min(cut, len(lists) - 1))
    expected = feast_bytes([np.array(v, np.int64) for v in column.to_pylist()], ValueType.INT64_LIST)
    assert encode_values(column, Array(Int64), "x") == expected
    assert value_texts(column, Array(Int64)) == [None] * len(column)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(FLOAT32, max_size=70), min_size=1, max_size=20))
def test_float32_lists(lists):
    column = pa.chunked_array([pa.array(lists, pa.list_(pa.float32()))])
    expected = feast_bytes([np.array(v, np.float32) for v in lists], ValueType.FLOAT_LIST)
    assert encode_values(column, Array(Float32), "x") == expected


@settings(max_examples=40, deadline=None)
@given(st.lists(INT64, min_size=1, max_size=30))
def test_entity_keys_match_feast(ids):
    expected = [
        serialize_entity_key(
            EntityKey(join_keys=["user_id"], entity_values=[Value(int64_val=i)]),
            entity_key_serialization_version=3,
        )
        for i in ids
    ]
    assert entity_keys("user_id", np.array(ids, np.int64), 3) == expected


def test_what_it_cannot_reproduce_is_refused_by_name():
    with pytest.raises(UnsupportedForFastWrite, match="'model_version' has type"):
        encode_values(pa.array(["a"]), String, "model_version")
    with pytest.raises(UnsupportedForFastWrite, match="'age' has 1 null"):
        encode_values(pa.array([1, None], pa.int64()), Int64, "age")
    with pytest.raises(UnsupportedForFastWrite, match="elements"):
        encode_values(pa.array([[1, None]], pa.list_(pa.int64())), Array(Int64), "ids")
