"""The validation gate: every defect class caught with its reason, no row lost, partition-level failures raise
after the report is written, accepted rows in the exact contract types."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from features.schema import ADS_SCHEMA, DEFECTS, EVENTS_SCHEMA, SCHEMAS, USERS_SCHEMA
from features.sources.defects import inject_defects
from features.validation import (
    EVENT_DEFECT_REASONS,
    GateConfig,
    GateResult,
    ValidationGateError,
    validate_partition,
)
from tests.features.test_defects import DAY, make_partition

LENIENT = GateConfig(
    max_failure_rate=1.0, data_docs=False
)  # row-level checks only: never fails the partition
NOW = dt.datetime(2024, 3, 2, 0, 30, tzinfo=dt.UTC)  # ingestion shortly after the day closed


def _validate(table, frame, tmp_path, **kwargs) -> GateResult:
    kwargs.setdefault("day", DAY)
    kwargs.setdefault("now", NOW)
    kwargs.setdefault("config", LENIENT)
    return validate_partition(table, frame, report_dir=tmp_path / "reports", **kwargs)


def _assert_contract_types(frame: pd.DataFrame, schema: pa.Schema) -> None:
    assert frame.dtypes.equals(schema.empty_table().to_pandas().dtypes)
    pa.Table.from_pandas(frame, schema=schema, preserve_index=False)  # non-nullable fields hold no nulls
    if len(frame):  # arrow infers the exact types back (an empty text column would infer as null)
        inferred = pa.Table.from_pandas(frame, preserve_index=False).schema
        assert [inferred.field(f.name).type for f in schema] == schema.types


def _unchanged(before: pd.DataFrame, after: pd.DataFrame) -> np.ndarray:
    a = before.astype("string").fillna("<null>")
    b = after.astype("string").fillna("<null>")
    return ~(a != b).any(axis=1).to_numpy()


def test_clean_partition_passes_with_nothing_quarantined(tmp_path):
    events, ads = make_partition()
    result = _validate("events", events, tmp_path, ads=ads, config=GateConfig())
    assert result.quarantined.empty and result.counts == {} and result.failure_rate == 0.0
    assert result.errors == []
    pd.testing.assert_frame_equal(result.accepted, events)
    _assert_contract_types(result.accepted, EVENTS_SCHEMA)
    # the report: GX data docs (index + this validation's page) and our JSON summary
    assert result.report_dir == tmp_path / "reports" / "events"
    assert result.data_docs is not None and result.data_docs.is_file()
    pages = list((result.report_dir / "data_docs" / "validations").rglob("*.html"))
    assert {p.parent.parent.parent.name for p in pages} == {"events", "events_schema"}
    summary = json.loads(result.summary_path.read_text())
    assert summary["passed"] and summary["rows"] == summary["accepted"] == len(events)
    assert all(e["success"] for e in summary["expectations"])


@pytest.mark.parametrize("defect", [d for d in DEFECTS if d != "volume_drop"])
def test_each_defect_class_is_quarantined_with_its_reason_and_no_valid_row_is_lost(defect, tmp_path):
    events, ads = make_partition()
    dirty, injected = inject_defects(events, {defect: 0.05}, day=DAY, ads=ads, rng=np.random.default_rng(3))
    result = _validate("events", dirty, tmp_path, ads=ads)

    assert len(result.accepted) + len(result.quarantined) == len(dirty)
    assert set(result.counts) <= EVENT_DEFECT_REASONS[defect], result.counts
    assert sum(result.counts.values()) == injected[defect] == len(result.quarantined)
    assert set(result.quarantined["reason"]) == set(result.counts)
    # exactly the untouched rows are accepted, unchanged, in the contract's types
    clean = events[_unchanged(events, dirty)].reset_index(drop=True)
    pd.testing.assert_frame_equal(result.accepted, clean)
    _assert_contract_types(result.accepted, EVENTS_SCHEMA)


def test_every_defect_class_at_once(tmp_path):
    events, ads = make_partition(n=4_000)
    rates = {d: 0.02 for d in DEFECTS if d != "volume_drop"}
    dirty, injected = inject_defects(events, rates, day=DAY, ads=ads, rng=np.random.default_rng(5))
    result = _validate("events", dirty, tmp_path, ads=ads)
    assert len(result.accepted) + len(result.quarantined) == len(dirty)
    assert len(result.quarantined) == sum(injected.values())
    by_reason = result.quarantined["reason"].value_counts()
    for defect, rows in injected.items():
        assert by_reason[by_reason.index.isin(EVENT_DEFECT_REASONS[defect])].sum() == rows, defect
    # the quarantine is writable as it is (the bad_type column stays text)
    result.quarantined.to_parquet(tmp_path / "quarantine.parquet")


def test_unparseable_values_are_kept_as_text_with_a_type_reason(tmp_path):
    events, ads = make_partition(n=500)
    dirty = events.copy()
    dirty["user_id"] = dirty["user_id"].astype(str).astype(object)
    dirty.loc[[3, 10, 42], "user_id"] = ["12abc", "N/A", "1e5"]
    result = _validate("events", dirty, tmp_path, ads=ads)
    assert result.counts == {"expect_column_values_to_match_regex(user_id)[int64]": 3}
    assert list(result.quarantined["user_id"]) == ["12abc", "N/A", "1e5"]
    pd.testing.assert_frame_equal(result.accepted, events.drop(index=[3, 10, 42]).reset_index(drop=True))


def test_text_partition_is_parsed_into_the_contract_types(tmp_path):
    """A partition landed as text (e.g. from CSV): every column parses, nothing is quarantined."""
    events, ads = make_partition(n=300)
    text = events.astype(str)
    text["ts"] = events["ts"].map(lambda t: t.isoformat())
    result = _validate("events", text, tmp_path, ads=ads)
    assert result.quarantined.empty
    pd.testing.assert_frame_equal(result.accepted, events)


def test_timestamps_that_do_not_parse_get_a_type_reason(tmp_path):
    events, ads = make_partition(n=50)
    text = events.copy()
    text["ts"] = events["ts"].map(lambda t: t.isoformat()).astype(object)
    text.loc[[5, 6], "ts"] = ["yesterday", "2024-02-30T10:00:00Z"]  # the second only fails the calendar
    result = _validate("events", text, tmp_path, ads=ads)
    assert result.counts == {"expect_column_values_to_match_regex(ts)[timestamp]": 2}
    assert list(result.quarantined["ts"]) == ["yesterday", "2024-02-30T10:00:00Z"]
    pd.testing.assert_frame_equal(result.accepted, events.drop(index=[5, 6]).reset_index(drop=True))


def test_list_column_written_as_text(tmp_path):
    _, ads = make_partition(n=10)
    text = ads.head(4).copy()
    text["categories"] = ["[1, 2]", "[3]", "three", None]
    result = _validate("ads", text, tmp_path)
    assert dict(zip(result.quarantined["ad_id"], result.quarantined["reason"], strict=True)) == {
        2: "expect_column_values_to_match_regex(categories)[list<int32>]",
        3: "expect_column_values_to_not_be_null(categories)",
    }
    assert [list(c) for c in result.accepted["categories"]] == [[1, 2], [3]]
    _assert_contract_types(result.accepted, ADS_SCHEMA)


def test_parquet_round_trip_of_nulls_in_int_columns(tmp_path):
    """Nulls in int columns come back from parquet as float64; the remaining values still parse exactly."""
    events, ads = make_partition(n=500)
    dirty, injected = inject_defects(
        events, {"null_field": 0.1}, day=DAY, ads=ads, rng=np.random.default_rng(0)
    )
    path = tmp_path / "events.parquet"
    pq.write_table(pa.Table.from_pandas(dirty, preserve_index=False).replace_schema_metadata(None), path)
    landed = pd.read_parquet(path)
    assert any(pd.api.types.is_float_dtype(landed[c]) for c in ("event_id", "user_id", "ad_id"))
    result = _validate("events", landed, tmp_path, ads=ads)
    assert len(result.quarantined) == injected["null_field"]
    assert set(result.counts) <= EVENT_DEFECT_REASONS["null_field"]
    _assert_contract_types(result.accepted, EVENTS_SCHEMA)


def test_failure_rate_above_threshold_raises_after_writing_the_report(tmp_path):
    events, ads = make_partition()
    dirty, injected = inject_defects(
        events, {"bad_enum": 0.1}, day=DAY, ads=ads, rng=np.random.default_rng(1)
    )
    with pytest.raises(
        ValidationGateError, match="failure rate 10.00% exceeds max_failure_rate 5.00%"
    ) as err:
        _validate("events", dirty, tmp_path, ads=ads, config=GateConfig(max_failure_rate=0.05))
    result = err.value.result
    assert len(result.quarantined) == injected["bad_enum"]  # the caller writes this before re-raising
    assert len(result.accepted) + len(result.quarantined) == len(dirty)
    summary = json.loads(result.summary_path.read_text())
    assert summary["passed"] is False and summary["failure_rate"] == pytest.approx(0.1)
    assert result.data_docs.is_file()


def test_volume_drop_against_the_previous_partition_fails(tmp_path):
    events, ads = make_partition()
    dropped, injected = inject_defects(
        events, {"volume_drop": 0.9}, day=DAY, ads=ads, rng=np.random.default_rng(2)
    )
    with pytest.raises(ValidationGateError, match="volume dropped") as err:
        _validate("events", dropped, tmp_path, ads=ads, previous_count=len(events))
    result = err.value.result
    assert injected["volume_drop"] == len(events) - len(dropped)
    assert result.quarantined.empty  # the rows themselves are fine: the partition is incomplete
    summary = json.loads(result.summary_path.read_text())
    failed = [e for e in summary["expectations"] if not e["success"]]
    assert [e["reason"] for e in failed] == list(EVENT_DEFECT_REASONS["volume_drop"])
    # the same partition passes when the previous one was comparable
    _validate("events", dropped, tmp_path, ads=ads, previous_count=len(dropped) + 10)


def test_a_quiet_day_passes_only_with_the_sources_volume_setting(tmp_path):
    # MovieLens' 1997-10-06: 124 ratings after a day of 927 — a real quiet day, not a lost load
    events, ads = make_partition(n=124)
    strict = GateConfig(data_docs=False)  # the default volume rule (0.2 x previous)
    with pytest.raises(ValidationGateError, match=r"volume dropped: 124 rows < 186 .*gate.min_volume_ratio"):
        _validate("events", events, tmp_path, ads=ads, previous_count=927, config=strict)

    for setting in ({"min_volume_ratio": 0.0}, {"min_volume_baseline": 1_000}):
        config = GateConfig(data_docs=False, **setting)
        result = _validate("events", events, tmp_path, ads=ads, previous_count=927, config=config)
        assert len(result.accepted) == 124 and result.errors == []
        summary = json.loads(result.summary_path.read_text())
        assert summary["passed"] and not any("volume" in e["reason"] for e in summary["expectations"])
        assert summary["config"]["min_volume_baseline"] == config.min_volume_baseline

    # a baseline below the previous partition keeps the rule
    with pytest.raises(ValidationGateError, match="volume dropped"):
        config = GateConfig(data_docs=False, min_volume_baseline=500)
        _validate("events", events, tmp_path, ads=ads, previous_count=927, config=config)


@pytest.mark.parametrize("bad", [-1, 2.5, "many", True])
def test_a_bad_volume_baseline_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="min_volume_baseline must be"):
        GateConfig(min_volume_baseline=bad)


def test_missing_column_quarantines_everything_and_fails(tmp_path):
    events, ads = make_partition(n=100)
    with pytest.raises(ValidationGateError, match="missing column") as err:
        _validate("events", events.drop(columns=["surface"]), tmp_path, ads=ads)
    result = err.value.result
    assert result.counts == {"expect_column_to_exist(surface)": 100}
    assert result.accepted.empty
    _assert_contract_types(result.accepted, EVENTS_SCHEMA)


def test_clock_skew_allowance_for_future_timestamps(tmp_path):
    events, ads = make_partition(n=10)
    now = dt.datetime(2024, 3, 1, 12, 0, tzinfo=dt.UTC)  # ingesting while the day is still open
    events["ts"] = pd.Timestamp(now) + pd.to_timedelta(np.arange(10), unit="min")
    events["ts"] = events["ts"].astype("datetime64[us, UTC]")
    result = _validate("events", events, tmp_path, ads=ads, now=now, config=GateConfig(max_failure_rate=1.0))
    assert result.counts == {"expect_column_values_to_be_between(ts)[not_future]": 4}  # 6..9 min > 5 min skew
    assert list(result.accepted["event_id"]) == list(events["event_id"][:6])


def test_duplicate_keeps_the_first_occurrence(tmp_path):
    events, ads = make_partition(n=20)
    replayed = pd.concat([events, events.iloc[[4, 4, 7]]], ignore_index=True)
    result = _validate("events", replayed, tmp_path, ads=ads)
    assert result.counts == {"expect_column_values_to_be_unique(event_id)": 3}
    pd.testing.assert_frame_equal(result.accepted, events)


def test_users_partition(tmp_path):
    users = pd.DataFrame(
        {
            "user_id": np.arange(6, dtype=np.int64),
            "age": np.array([25, 7, 40, 33, 61, 130], dtype=np.int16),
            "gender": ["female", "male", "robot", "unknown", "male", "female"],
            "country": np.array([1, 2, 3, -4, 5, 6], dtype=np.int32),
            "signup_ts": pd.to_datetime(["2023-01-01"] * 4 + ["2031-01-01", "2023-05-05"], utc=True).astype(
                "datetime64[us, UTC]"
            ),
        }
    )
    result = _validate("users", users, tmp_path)
    assert dict(zip(result.quarantined["user_id"], result.quarantined["reason"], strict=True)) == {
        1: "expect_column_values_to_be_between(age)",
        2: "expect_column_values_to_be_in_set(gender)",
        3: "expect_column_values_to_be_between(country)",
        4: "expect_column_values_to_be_between(signup_ts)[not_future]",
        5: "expect_column_values_to_be_between(age)",
    }
    assert list(result.accepted["user_id"]) == [0]
    _assert_contract_types(result.accepted, USERS_SCHEMA)


def test_ads_partition(tmp_path):
    _, ads = make_partition(n=10)
    ads = ads.head(6).copy()
    ads["quality"] = ads["quality"].astype(object)
    ads.loc[1, "quality"] = 1.5
    ads.loc[2, "quality"] = "high"
    ads.loc[3, "advertiser_id"] = -2
    ads.loc[4, "ad_id"] = 0  # a second ad 0
    ads.loc[5, "categories"] = None
    result = _validate("ads", ads, tmp_path)
    assert list(result.quarantined["reason"]) == [
        "expect_column_values_to_be_between(quality)",
        "expect_column_values_to_match_regex(quality)[float]",
        "expect_column_values_to_be_between(advertiser_id)",
        "expect_column_values_to_be_unique(ad_id)",
        "expect_column_values_to_not_be_null(categories)",
    ]
    assert list(result.accepted["ad_id"]) == [0]
    _assert_contract_types(result.accepted, ADS_SCHEMA)
    result.quarantined.to_parquet(tmp_path / "ads_quarantine.parquet")


def test_events_without_ads_skip_only_referential_integrity(tmp_path):
    events, _ = make_partition(n=50)
    events.loc[0, "ad_id"] = 10**9
    result = _validate("events", events, tmp_path)
    assert result.quarantined.empty
    assert json.loads(result.summary_path.read_text())["referential_integrity"] is False


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p, e: validate_partition("clicks", e, day=DAY, report_dir=p), ValueError, "unknown table"),
        (
            lambda p, e: validate_partition("events", e.to_dict(), day=DAY, report_dir=p),
            TypeError,
            "DataFrame",
        ),
        (
            lambda p, e: validate_partition("events", e, day=DAY, report_dir=p, now=dt.datetime(2024, 3, 2)),
            ValueError,
            "timezone-aware",
        ),
        (
            lambda p, e: validate_partition(
                "events", pd.concat([e, e["user_id"]], axis=1), day=DAY, report_dir=p
            ),
            ValueError,
            "duplicate column name",
        ),
        (lambda p, e: GateConfig(max_failure_rate=2.0), ValueError, "max_failure_rate"),
        (lambda p, e: GateConfig(clock_skew="soon"), ValueError, "clock_skew"),
    ],
)
def test_bad_arguments_are_named(call, error, message, tmp_path):
    events, _ = make_partition(n=10)
    with pytest.raises(error, match=message):
        call(tmp_path, events)


def test_clock_skew_accepts_seconds_from_yaml():
    assert GateConfig(clock_skew=60).clock_skew == dt.timedelta(minutes=1)


def test_every_table_has_a_suite(tmp_path):
    for table, schema in SCHEMAS.items():
        empty = schema.empty_table().to_pandas()
        result = _validate(table, empty, tmp_path)
        assert result.accepted.empty and result.failure_rate == 0.0


def test_timestamps_before_the_minimum_are_quarantined(tmp_path):
    """A 1969-12-31 partition (negative epochs) passes the partition window but not ``GateConfig.min_ts``."""
    day = dt.date(1969, 12, 31)
    events, ads = make_partition(n=6)
    events["ts"] = pd.Timestamp("1969-12-31T10:00:00Z") + pd.to_timedelta(np.arange(6), unit="min")
    events["ts"] = events["ts"].astype("datetime64[us, UTC]")
    ads["created_ts"] = pd.Timestamp("1969-12-31T00:00:00Z")
    ads["created_ts"] = ads["created_ts"].astype("datetime64[us, UTC]")
    result = _validate("events", events, tmp_path, ads=ads, day=day)
    assert result.counts == {"expect_column_values_to_be_between(ts)[not_before_min_ts]": 6}
    allowed = GateConfig(max_failure_rate=1.0, data_docs=False, min_ts="1960-01-01")
    assert _validate("events", events, tmp_path / "b", ads=ads, day=day, config=allowed).counts == {}
    with pytest.raises(ValueError, match="min_ts must be a date"):
        GateConfig(min_ts="yesterday")
