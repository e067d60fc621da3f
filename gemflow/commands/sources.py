"""Event-log source commands: ``generate`` (synthetic), ``import-movielens``, ``import-interactions``,
``import-sequences``.

Each writes raw day partitions into the workspace and records the config it used (and a summary) under
``<workspace>/raw/_runs/<source>-<time>/``; the summary is also printed as JSON.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from gemflow.commands.common import ConfigOpt, SetOpt, WorkspaceOpt, config, parse_date, workspace
from gemflow.config import ConfigError, load_config
from gemflow.exit_codes import BAD_INPUT

Col = Annotated[str | None, typer.Option(help="Column name.")]


def parse_inject(text: str | None) -> dict[str, float]:
    """``null_field=0.01,bad_enum=0.02`` -> {"null_field": 0.01, "bad_enum": 0.02}."""
    rates: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, rate = item.partition("=")
        try:
            if not sep:
                raise ValueError
            rates[name.strip()] = float(rate)
        except ValueError as err:
            raise typer.BadParameter(
                f"--inject {item!r} must look like defect=rate, e.g. null_field=0.01"
            ) from err
    return rates


def _fail(err: Exception) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(code=BAD_INPUT)


def register(app: typer.Typer) -> None:
    @app.command("generate")
    def generate(
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
        days: Annotated[int | None, typer.Option(help="Number of day partitions.")] = None,
        users: Annotated[int | None, typer.Option(help="Number of users.")] = None,
        start_date: Annotated[str | None, typer.Option(help="First day, e.g. 2026-01-01.")] = None,
        seed: Annotated[int | None, typer.Option(help="Random seed (same seed -> identical files).")] = None,
        inject: Annotated[
            str | None, typer.Option(help="Defects to inject, e.g. null_field=0.01,bad_enum=0.01.")
        ] = None,
        inject_day: Annotated[
            list[str] | None, typer.Option(help="Only corrupt this day (repeatable; default: every day).")
        ] = None,
        progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    ) -> None:
        """Synthetic ads event logs with planted structure (see features/sources/synthetic.py)."""
        from features.sources.synthetic import SyntheticConfig
        from features.sources.synthetic import generate as run

        if start_date is not None:
            parse_date(start_date)
        cfg = config(
            SyntheticConfig, cfg_path, overrides, days=days, num_users=users, start_date=start_date, seed=seed
        )
        rates = parse_inject(inject)
        only = [parse_date(d) for d in inject_day] if inject_day else None
        try:
            summary = run(cfg, workspace(ws), inject=rates, inject_days=only, progress=progress)
        except (ValueError, RuntimeError) as err:
            raise _fail(err) from err
        typer.echo(json.dumps(summary, indent=2))

    @app.command("import-movielens")
    def import_movielens(
        ws: WorkspaceOpt = None,
        data_dir: Annotated[
            Path | None,
            typer.Option(help="Folder with ml-100k.{inter,item,user}.gz (default ../shared/data)."),
        ] = None,
        progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
        positive_only: Annotated[
            bool,
            typer.Option("--positive-only", help="Every rating is one positive interaction (no labels)."),
        ] = False,
    ) -> None:
        """MovieLens-100K -> raw day partitions, through the generic importer (research use only)."""
        from features.sources.movielens import DEFAULT_DIR
        from features.sources.movielens import import_movielens as run

        try:
            summary = run(
                workspace(ws), data_dir or DEFAULT_DIR, progress=progress, positive_only=positive_only
            )
        except (ValueError, FileNotFoundError) as err:
            raise _fail(err) from err
        typer.echo(json.dumps(summary, indent=2))

    @app.command("import-interactions")
    def import_interactions(
        file: Annotated[
            Path, typer.Argument(help="Interaction log: .csv, .tsv or .parquet (optionally .gz).")
        ],
        cfg_path: ConfigOpt = None,
        overrides: SetOpt = None,
        ws: WorkspaceOpt = None,
        items: Annotated[
            Path | None, typer.Option(help="Item table (item attributes), keyed by --item-col.")
        ] = None,
        users: Annotated[
            Path | None, typer.Option(help="User table (user attributes), keyed by --user-col.")
        ] = None,
        user_col: Col = None,
        item_col: Col = None,
        ts_col: Col = None,
        ts_unit: Annotated[str | None, typer.Option(help="Unit of numeric timestamps: s, ms, us.")] = None,
        ts_format: Annotated[
            str | None, typer.Option(help="strptime format of text timestamps, e.g. '%d/%m/%Y %H:%M'.")
        ] = None,
        min_ts: Annotated[
            str | None, typer.Option(help="Rows before this time are quarantined (default 1990-01-01).")
        ] = None,
        order_col: Col = None,
        label_col: Col = None,
        conversion_col: Annotated[
            str | None, typer.Option(help="0/1 purchase or conversion column (a conversion is a positive).")
        ] = None,
        rating_col: Col = None,
        positive_rating: Annotated[float | None, typer.Option(help="label = rating >= this.")] = None,
        positive_only: Annotated[
            bool | None, typer.Option("--positive-only", help="Every row is a positive (no labels).")
        ] = None,
        strong_rating: Annotated[float | None, typer.Option(help="rating >= this also converts.")] = None,
        attrs_col: Col = None,
        attr_sep: Annotated[
            str | None, typer.Option(help="Separator of the attribute list (default |).")
        ] = None,
        advertiser_col: Col = None,
        age_col: Col = None,
        gender_col: Col = None,
        country_col: Col = None,
        surface: Annotated[str | None, typer.Option(help="Surface of every event (default feed).")] = None,
        unlabeled_action: Annotated[str | None, typer.Option(help="Action of unlabeled rows (view).")] = None,
        base_date: Annotated[
            str | None, typer.Option(help="Start of synthetic timestamps (order-only).")
        ] = None,
        delimiter: Annotated[
            str | None, typer.Option(help="CSV delimiter (default by extension; 'tab').")
        ] = None,
        encoding: Annotated[
            str | None, typer.Option(help="Text encoding of the file (default utf-8; e.g. latin-1).")
        ] = None,
        source: Annotated[str, typer.Option(help="Name of the run folder prefix.")] = "interactions",
        progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    ) -> None:
        """Any (user, item, time-or-order, label/rating, attributes) log -> raw day partitions
        (docs/interaction-format.md)."""
        from features.sources.interaction_format import InteractionFormat
        from features.sources.interactions import import_interactions as run

        try:
            fmt = load_config(InteractionFormat, cfg_path, overrides or [])
        except ConfigError as err:
            raise typer.BadParameter(str(err)) from err
        # Flags are applied as typed values, not parsed as YAML: separators like "|" or " " stay strings.
        flags = dict(
            user_col=user_col, item_col=item_col, ts_col=ts_col, ts_unit=ts_unit, ts_format=ts_format,
            min_ts=min_ts, encoding=encoding, order_col=order_col,
            label_col=label_col, conversion_col=conversion_col, rating_col=rating_col, positive_rating=positive_rating, positive_only=positive_only,
            strong_rating=strong_rating, item_attrs_col=attrs_col, attr_sep=_unescape(attr_sep),
            advertiser_col=advertiser_col, age_col=age_col, gender_col=gender_col, country_col=country_col,
            surface=surface, unlabeled_action=unlabeled_action, base_date=base_date, delimiter=_unescape(delimiter),
        )  # fmt: skip
        fmt = dataclasses.replace(fmt, **{k: v for k, v in flags.items() if v is not None})
        try:
            summary = run(
                file, fmt, workspace(ws), items=items, users=users, source=source, progress=progress
            )
        except ValueError as err:
            raise _fail(err) from err
        for warning in summary.get("warnings", []):
            typer.echo(f"warning: {warning}", err=True)
        typer.echo(json.dumps(summary, indent=2))

    @app.command("import-sequences")
    def import_sequences(
        file: Annotated[
            Path, typer.Argument(help="One user per line: user item_1 ... item_n, oldest first (.gz ok).")
        ],
        ws: WorkspaceOpt = None,
        item_attributes: Annotated[
            Path | None, typer.Option(help='Item attributes, JSON {"item": [attribute, ...]} (.gz ok).')
        ] = None,
        base_date: Annotated[
            str | None, typer.Option(help="Synthetic time of each user's first item (default 2026-01-01).")
        ] = None,
        progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    ) -> None:
        """A positive-only sequence file (Amazon / S3-Rec style) -> raw day partitions (order-only times)."""
        from features.sources.sequences import SEQUENCE_FORMAT
        from features.sources.sequences import import_sequences as run

        fmt = (
            SEQUENCE_FORMAT
            if base_date is None
            else dataclasses.replace(SEQUENCE_FORMAT, base_date=base_date)
        )
        try:
            summary = run(file, workspace(ws), item_attributes=item_attributes, fmt=fmt, progress=progress)
        except ValueError as err:
            raise _fail(err) from err
        typer.echo(json.dumps(summary, indent=2))


def _unescape(text: str | None) -> str | None:
    if text is None:
        return None
    return {"tab": "\t", "\\t": "\t", "space": " "}.get(text, text)
