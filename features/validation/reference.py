"""Referential integrity as a GX expectation: every value of a column exists in another table's key set.

Core GX can say this only with ``expect_column_values_to_be_in_set(value_set=[...])``, which puts the whole key
set inside the expectation config; GX re-serializes that config many times per run, so 20,000 ad ids cost ~6 s
per partition. ``ExpectColumnValuesToBeInReference`` instead names a key set registered for the duration of one
validation (``registered_reference``); the check itself is GX's own column-map machinery (a vectorized
``isin``), so failing rows come back in ``unexpected_index_list`` like any other expectation's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import numpy as np
import pandas as pd
from great_expectations.execution_engine import PandasExecutionEngine, SparkDFExecutionEngine
from great_expectations.expectations.expectation import ColumnMapExpectation
from great_expectations.expectations.metrics.map_metric_provider import (
    ColumnMapMetricProvider,
    column_condition_partial,
)

_REFERENCES: dict[str, pd.Index] = {}


@contextmanager
def registered_reference(name: str, keys: np.ndarray | pd.Series) -> Iterator[str]:
    """Make ``keys`` available to the expectation under a fresh handle (unique per run, so GX never reuses a
    cached metric computed against another partition's keys)."""
    handle = f"{name}:{uuid.uuid4().hex}"
    _REFERENCES[handle] = pd.Index(pd.unique(np.asarray(keys)))
    try:
        yield handle
    finally:
        _REFERENCES.pop(handle, None)


class ColumnValuesInReference(ColumnMapMetricProvider):
    condition_metric_name = "column_values.in_reference"
    condition_value_keys = ("reference",)

    @column_condition_partial(engine=PandasExecutionEngine)
    def _pandas(cls, column, reference, **kwargs):
        return column.isin(_known(reference))

    @column_condition_partial(engine=SparkDFExecutionEngine)
    def _spark(cls, column, reference, **kwargs):
        # An IN over the key list (Spark turns it into a hash set); ads are few next to events.
        return column.isin(_known(reference).tolist())


def _known(reference: str) -> pd.Index:
    if reference not in _REFERENCES:
        raise KeyError(f"reference key set {reference!r} is not registered (use registered_reference)")
    return _REFERENCES[reference]


class ExpectColumnValuesToBeInReference(ColumnMapExpectation):
    """Expect each value of ``column`` to exist in the registered key set ``reference`` (a foreign key)."""

    reference: str

    map_metric = "column_values.in_reference"
    args_keys = ("column", "reference")
    success_keys = ("reference", "mostly")
    domain_keys: ClassVar[tuple[str, ...]] = ("column", "row_condition", "condition_parser")
