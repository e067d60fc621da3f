"""One reported event -> a checked ``Event``, or the reason it is refused.

The rules are the raw-log contract's (``features.schema``) as the daily gate applies them, and a refused event
carries the gate's own reason name (``features.validation.suites.reason_name``), so a quarantined live event
reads like a quarantined batch row. An event is JSON::

    {"event_id": 123, "user_id": 7, "ad_id": 42, "action": "click", "surface": "feed",
     "ts": "2026-01-05T18:00:00.123456+00:00", "click": 0, "conversion": 0}

``ts`` is ISO 8601 with a UTC offset (a naive time is refused: the log is UTC). It may lead the server clock by
``clock_skew_s`` and trail it by ``max_age_days``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from features.schema import ACTION_ID, ACTIONS, SURFACE_ID, SURFACES
from features.validation.suites import reason_name
from serving.events.ads import AdLookup

INT64_MAX = 2**63 - 1
IDS = ("event_id", "user_id", "ad_id")
FIELDS = (*IDS, "action", "surface", "ts", "click", "conversion")
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


@dataclass(frozen=True)
class Event:
    event_id: int
    user_id: int
    ad_id: int
    action: int  # ACTIONS id
    surface: int  # SURFACES id
    ts_us: int
    click: int
    conversion: int
    category_id: int
    advertiser_id: int


class Refused(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _int(value, name: str, low: int, high: int, tag: str | None = None) -> int:
    if value is None:
        raise Refused(reason_name("expect_column_values_to_not_be_null", name), f"{name} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise Refused(
            reason_name("expect_column_values_to_match_regex", name, "int8" if high == 1 else "int64"),
            f"{name} must be an integer, got {value!r}"[:200],
        )
    if not low <= value <= high:
        kind = "expect_column_values_to_be_in_set" if high == 1 else "expect_column_values_to_be_between"
        raise Refused(reason_name(kind, name, tag), f"{name}={value} is outside [{low}, {high}]")
    return value


def _vocab(value, name: str, ids: dict[str, int], vocabulary: tuple[str, ...]) -> int:
    if value is None:
        raise Refused(reason_name("expect_column_values_to_not_be_null", name), f"{name} is missing")
    if not isinstance(value, str) or value not in ids:
        raise Refused(
            reason_name("expect_column_values_to_be_in_set", name),
            f"{name}={value!r} is not one of {list(vocabulary)}"[:200],
        )
    return ids[value]


def _ts_us(value, now: dt.datetime, skew_s: float, max_age_days: float) -> int:
    if value is None:
        raise Refused(reason_name("expect_column_values_to_not_be_null", "ts"), "ts is missing")
    bad_type = reason_name("expect_column_values_to_match_regex", "ts", "timestamp")
    if not isinstance(value, str):
        raise Refused(bad_type, f"ts must be an ISO 8601 string with a UTC offset, got {value!r}"[:200])
    try:
        ts = dt.datetime.fromisoformat(value)
    except ValueError:
        raise Refused(bad_type, f"ts {value!r} is not ISO 8601"[:200]) from None
    if ts.tzinfo is None:
        raise Refused(bad_type, f"ts {value!r} has no UTC offset (the event log is UTC)"[:200])
    if ts > now + dt.timedelta(seconds=skew_s):
        raise Refused(
            reason_name("expect_column_values_to_be_between", "ts", "not_future"),
            f"ts {value} is ahead of the server clock ({now.isoformat()}) by more than {skew_s:g} s",
        )
    if ts < now - dt.timedelta(days=max_age_days):
        raise Refused(
            reason_name("expect_column_values_to_be_between", "ts", "partition_window"),
            f"ts {value} is more than {max_age_days:g} days old: land it with its day's batch instead",
        )
    delta = ts - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def check_event(
    raw, ads: AdLookup, now: dt.datetime, skew_s: float = 300.0, max_age_days: float = 28.0
) -> Event:
    """``raw`` (one decoded JSON object) -> ``Event``; raises ``Refused`` naming the first broken rule."""
    if not isinstance(raw, dict):
        raise Refused("not_an_object", f"an event must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise Refused("unknown_field", f"unknown field(s) {unknown[:5]}; an event has {list(FIELDS)}")
    ids = {name: _int(raw.get(name), name, 0, INT64_MAX) for name in IDS}
    action = _vocab(raw.get("action"), "action", ACTION_ID, ACTIONS)
    surface = _vocab(raw.get("surface"), "surface", SURFACE_ID, SURFACES)
    ts_us = _ts_us(raw.get("ts"), now, skew_s, max_age_days)
    click = _int(raw.get("click", 0), "click", 0, 1)
    conversion = _int(raw.get("conversion", 0), "conversion", 0, 1)
    if action != ACTION_ID["impression"] and (click or conversion):
        column = "click" if click else "conversion"
        raise Refused(
            reason_name("expect_column_values_to_be_in_set", column, "non_impression"),
            f"{column}=1 on a {ACTIONS[action]}: labels live on impressions only",
        )
    if conversion > click:
        raise Refused(
            reason_name("expect_column_pair_values_a_to_be_greater_than_b", "click,conversion"),
            "conversion=1 without click=1",
        )
    found = ads.find(ids["ad_id"])
    if found is None:
        raise Refused(
            reason_name("expect_column_values_to_be_in_reference", "ad_id", "ads"),
            f"ad_id {ids['ad_id']} is not in the ads snapshot ({ads.snapshot or 'none loaded'})",
        )
    category, advertiser = found
    return Event(
        event_id=ids["event_id"],
        user_id=ids["user_id"],
        ad_id=ids["ad_id"],
        action=action,
        surface=surface,
        ts_us=ts_us,
        click=click,
        conversion=conversion,
        category_id=category,
        advertiser_id=advertiser,
    )
