"""The generic interaction importer: timestamps or order, labels and ratings, string ids, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from features.schema import SCHEMAS
from features.sources.interaction_format import InteractionFormat, InteractionFormatError, read_table
from features.sources.interactions import import_interactions
from features.vocabulary import text_id
from gemflow.commands import sources as source_commands
from gemflow.workspace import Workspace

LOG = pd.DataFrame(
    {
        "who": ["alice", "bob", "alice", "carol", "bob", "alice"],
        "what": ["i1", "i2", "i2", "i3", "i1", "i3"],
        "when": [
            "2026-02-01T10:00:00Z",
            "2026-02-01T11:30:00Z",
            "2026-02-01T23:59:59.500Z",  # its click lands 1 s later, on the next day
            "2026-02-02T08:00:00+02:00",  # offsets are honoured: 06:00 UTC
            "2026-02-02T09:00:00Z",
            "2026-02-03T12:00:00Z",
        ],
        "stars": [5, 2, 4, 3, 5, 1],
        "tags": ["shoes|sport", "books", "books|kids", "", "shoes|sport", "garden"],
        "brand": ["acme", "readco", "readco", None, "acme", "greenly"],
        "age": [34, 51, 34, 9, 51, 34],
        "sex": ["F", "m", "F", "unknown", "m", "F"],
        "city": ["Paris", "Oslo", "Paris", "Lima", "Oslo", "Paris"],
    }
)
RATED = InteractionFormat(
    user_col="who",
    item_col="what",
    ts_col="when",
    rating_col="stars",
    positive_rating=4,
    strong_rating=5,
    item_attrs_col="tags",
    advertiser_col="brand",
    age_col="age",
    gender_col="sex",
    country_col="city",
)


def _all(ws: Workspace, table: str) -> pd.DataFrame:
    parts = sorted(ws.raw(table).glob("date=*"))
    return pd.concat([pd.read_parquet(p).assign(day=p.name[5:]) for p in parts], ignore_index=True)


def test_timestamped_csv_with_ratings_and_string_ids(tmp_path):
    path = tmp_path / "log.csv"
    LOG.to_csv(path, index=False)
    ws = Workspace(tmp_path / "ws")
    summary = import_interactions(path, RATED, ws, progress=False)

    assert summary["interactions"] == 6 and summary["positives"] == 3 and summary["conversions"] == 2
    assert summary["events"] == 6 + 3 + 2 and summary["users"] == 3 and summary["items"] == 3
    assert summary["ages_clipped"] == 1
    events = _all(ws, "events")
    assert (events.action == "impression").sum() == 6
    # Every partition holds exactly its day, in the exact schema.
    for part in sorted(ws.raw("events").glob("date=*")):
        frame = pd.read_parquet(part)
        start = pd.Timestamp(part.name[5:], tz="UTC")
        assert frame.ts.min() >= start and frame.ts.max() < start + pd.Timedelta(days=1)
        for table, file in [
            ("events", "part-00000.parquet"),
            ("users", "users.parquet"),
            ("ads", "ads.parquet"),
        ]:
            folder = ws.raw(table, start.date())
            assert pq.read_schema(folder / file).remove_metadata().equals(SCHEMAS[table])
    assert summary["first_day"] == "2026-02-01" and summary["last_day"] == "2026-02-03"

    alice, i2 = text_id("alice"), text_id("i2")
    late = events[(events.user_id == alice) & (events.ad_id == i2)].sort_values("event_id")
    assert late.action.tolist() == ["impression", "click"]
    assert late.day.tolist() == ["2026-02-01", "2026-02-02"]
    assert (late.ts.iloc[1] - late.ts.iloc[0]) == pd.Timedelta(seconds=1)
    five_star = events[(events.user_id == alice) & (events.ad_id == text_id("i1"))].sort_values("event_id")
    assert five_star.action.tolist() == ["impression", "click", "conversion"]
    assert five_star[["click", "conversion"]].values.tolist() == [[1, 1], [0, 0], [0, 0]]
    assert (five_star.ts.diff().dropna() == pd.Timedelta(seconds=1)).all()
    carol = events[events.user_id == text_id("carol")]
    assert carol.ts.iloc[0] == pd.Timestamp("2026-02-02T06:00:00Z")
    assert events.event_id.is_unique and events.sort_values("event_id").ts.is_monotonic_increasing

    run = Path(summary["run_dir"])
    vocab = json.loads((run / "vocabularies.json").read_text())
    assert vocab["category"] == ["books", "garden", "shoes", "sport"]  # first non-empty tags per item
    assert vocab["advertiser"] == ["acme", "greenly", "readco"]
    ads = pd.read_parquet(ws.raw("ads", pd.Timestamp("2026-02-03").date()) / "ads.parquet").set_index("ad_id")
    i1 = ads.loc[text_id("i1")]
    assert i1.category_id == vocab["category"].index("shoes") and list(i1.categories) == [2, 3]
    # i3's first row (carol) has no brand: the first non-empty one (greenly) counts.
    assert i1.advertiser_id == 1 and ads.loc[text_id("i3")].advertiser_id == 2
    assert (ads.quality == 0.5).all()
    users = pd.read_parquet(ws.raw("users", pd.Timestamp("2026-02-03").date()) / "users.parquet").set_index(
        "user_id"
    )
    assert users.loc[alice, "gender"] == "female" and users.loc[text_id("carol"), "age"] == 13
    ids = pd.read_parquet(run / "user_ids.parquet")
    assert dict(zip(ids.raw, ids.user_id, strict=True))["bob"] == text_id("bob")
    # Users and items appear in the snapshots from the day they are first seen.
    first_users = pd.read_parquet(ws.raw("users", pd.Timestamp("2026-02-01").date()) / "users.parquet")
    assert set(first_users.user_id) == {alice, text_id("bob")}


def test_same_string_id_gets_the_same_int_in_every_file(tmp_path):
    fmt = InteractionFormat(user_col="who", item_col="what", ts_col="when")
    a = import_interactions(LOG.iloc[:3], fmt, Workspace(tmp_path / "a"), progress=False)
    b = import_interactions(LOG.iloc[3:], fmt, Workspace(tmp_path / "b"), progress=False)
    ids_a = pd.read_parquet(Path(a["run_dir"]) / "user_ids.parquet").set_index("raw").user_id
    ids_b = pd.read_parquet(Path(b["run_dir"]) / "user_ids.parquet").set_index("raw").user_id
    assert ids_a["alice"] == ids_b["alice"] and ids_a["bob"] == ids_b["bob"]


def test_order_only_parquet_gets_one_synthetic_minute_per_step(tmp_path):
    log = pd.DataFrame(
        {"u": [7, 7, 8, 7, 8], "item": [1, 2, 3, 3, 1], "step": [30, 10, 1, 20, 2], "liked": [1, 0, 1, 0, 0]}
    )
    path = tmp_path / "log.parquet"
    log.to_parquet(path)
    ws = Workspace(tmp_path / "ws")
    fmt = InteractionFormat(
        user_col="u", item_col="item", order_col="step", label_col="liked", base_date="2025-05-05"
    )
    summary = import_interactions(path, fmt, ws, progress=False)
    assert summary["events"] == 5 + 2 and summary["days"] == 1
    events = _all(ws, "events")
    impressions = events[events.action == "impression"].sort_values(["user_id", "ts"])
    base = pd.Timestamp("2025-05-05", tz="UTC")
    assert impressions[impressions.user_id == 7].ad_id.tolist() == [2, 3, 1]  # by step, not by row
    assert impressions[impressions.user_id == 7].ts.tolist() == [
        base + pd.Timedelta(minutes=m) for m in range(3)
    ]
    assert impressions.set_index(["user_id", "ad_id"]).click.to_dict() == {
        (7, 2): 0,
        (7, 3): 0,
        (7, 1): 1,
        (8, 3): 1,
        (8, 1): 0,
    }
    assert set(events.user_id) == {7, 8}  # integer ids are kept as they are


def test_unlabeled_log_becomes_organic_views_and_separate_tables_join(tmp_path):
    log = pd.DataFrame(
        {"user": [1, 2, 1], "movie": [10, 10, 11], "t": [1_700_000_000, 1_700_000_060, 1_700_000_120]}
    )
    items = pd.DataFrame(
        {"movie": [10, 11, 12], "genres": [["drama"], ["comedy", "drama"], []], "year": [1999, None, 2001]}
    )
    users = pd.DataFrame({"user": [1, 2], "age": [25, None], "gender": ["f", None]})
    ws = Workspace(tmp_path)
    fmt = InteractionFormat(user_col="user", item_col="movie", ts_col="t", item_attrs_col="genres",
                            advertiser_col="year", age_col="age", gender_col="gender")  # fmt: skip
    summary = import_interactions(log, fmt, ws, items=items, users=users, progress=False)
    assert summary["events"] == 3 and summary["ages_missing"] == 1
    events = _all(ws, "events")
    assert set(events.action) == {"view"} and events[["click", "conversion"]].eq(0).all().all()
    ads = _all(ws, "ads").drop_duplicates("ad_id").set_index("ad_id")
    assert set(ads.index) == {10, 11, 12}  # the catalog, also items nobody touched
    assert ads.loc[11].advertiser_id == 0 and ads.loc[10].advertiser_id == 1999
    assert list(ads.loc[11].categories) == [1, 2] and ads.loc[11].category_id == 1  # comedy, drama
    assert list(ads.loc[12].categories) == [0] == [ads.loc[12].category_id]  # "<none>"
    users_out = _all(ws, "users").drop_duplicates("user_id").set_index("user_id")
    assert users_out.loc[2, "age"] == 30 and users_out.loc[2, "gender"] == "unknown"


@pytest.mark.parametrize(
    ("fmt", "frame", "message"),
    [
        (InteractionFormat(user_col="who", item_col="product", ts_col="when"), LOG, r"missing column\(s\) \['product'\]"),
        (InteractionFormat(user_col="who", item_col="what"), LOG, "ts_col .* or order_col"),
        (InteractionFormat(user_col="who", item_col="what", ts_col="tags"), LOG, "tags: not a timestamp"),
        (InteractionFormat(user_col="who", item_col="what", ts_col="when", label_col="sex"), LOG, "sex: not a 0/1 label"),
        (InteractionFormat(user_col="who", item_col="what", ts_col="when", rating_col="stars"), LOG, "positive_rating"),
        (InteractionFormat(user_col="who", item_col="what", ts_col="when", rating_col="city", positive_rating=4), LOG, "city: not a number"),
        (InteractionFormat(user_col="who", item_col="what", ts_col="when", gender_col="city"), LOG, "unknown gender"),
        (InteractionFormat(user_col="who", item_col="what", ts_col="when", surface="tv"), LOG, "surface 'tv'"),
        (InteractionFormat(user_col="who", item_col="what", ts_col="when"), LOG.assign(who=[None, "b", "c", "d", "e", "f"]), "who: empty user id in 1 row"),
        (InteractionFormat(user_col="stars", item_col="what", ts_col="when"), LOG.assign(stars=[-1, 2, 3, 4, 5, 6]), "stars: negative user id in 1 row"),
    ],
)  # fmt: skip
def test_bad_input_gives_a_clear_error(tmp_path, fmt, frame, message):
    ws = Workspace(tmp_path)
    with pytest.raises(InteractionFormatError, match=message):
        import_interactions(frame, fmt, ws, progress=False)
    assert not ws.raw("events").exists()


def test_bad_side_tables_and_files_give_clear_errors(tmp_path):
    fmt = InteractionFormat(user_col="who", item_col="what", ts_col="when", item_attrs_col="tags")
    with pytest.raises(InteractionFormatError, match="duplicate what"):
        import_interactions(
            LOG, fmt, Workspace(tmp_path), items=pd.DataFrame({"what": ["i1", "i1"], "tags": ["a", "b"]})
        )
    with pytest.raises(InteractionFormatError, match="none of its what values"):
        import_interactions(
            LOG, fmt, Workspace(tmp_path), items=pd.DataFrame({"what": [1, 2], "tags": ["a", "b"]})
        )
    (tmp_path / "log.xlsx").write_text("x")
    with pytest.raises(InteractionFormatError, match="unknown file type .xlsx"):
        read_table(tmp_path / "log.xlsx")
    with pytest.raises(InteractionFormatError, match="no such file"):
        read_table(tmp_path / "missing.csv")


def _cli() -> typer.Typer:
    app = typer.Typer()
    source_commands.register(app)
    return app


def test_cli_imports_a_tsv_and_records_its_config(tmp_path):
    path = tmp_path / "log.tsv.gz"
    LOG.to_csv(path, sep="\t", index=False)
    args = ["import-interactions", str(path), "-w", str(tmp_path / "ws"), "--user-col", "who", "--item-col", "what",
            "--ts-col", "when", "--rating-col", "stars", "--positive-rating", "4", "--attrs-col", "tags",
            "--attr-sep", "|", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(_cli(), args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["positives"] == 3 and summary["conversions"] == 0
    assert "attr_sep: '|'" in (Path(summary["run_dir"]) / "config.yaml").read_text()


def test_cli_reports_a_missing_column_without_a_traceback(tmp_path):
    path = tmp_path / "log.csv"
    LOG.to_csv(path, index=False)
    result = CliRunner().invoke(
        _cli(), ["import-interactions", str(path), "-w", str(tmp_path), "--ts-col", "when"]
    )
    assert result.exit_code == 2
    assert "missing column(s) ['user_id', 'item_id']" in result.output and "Traceback" not in result.output


def test_positive_only_log_is_one_labelled_impression_per_row(tmp_path):
    ws = Workspace(tmp_path / "ws")
    fmt = InteractionFormat(user_col="who", item_col="what", ts_col="when", positive_only=True)
    summary = import_interactions(LOG[["who", "what", "when"]], fmt, ws, progress=False)
    assert summary["events"] == summary["interactions"] == summary["positives"] == 6
    events = _all(ws, "events")
    assert set(events.action) == {"impression"} and events.click.eq(1).all() and events.conversion.eq(0).all()
    with pytest.raises(InteractionFormatError, match="positive_only logs carry no label_col or rating_col"):
        import_interactions(LOG, InteractionFormat(user_col="who", item_col="what", ts_col="when",
                                                   rating_col="stars", positive_rating=4, positive_only=True), ws)  # fmt: skip
