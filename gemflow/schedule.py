"""The trigger rule of the training DAGs: train when a day's features land, but not once per backfilled day.

An asset-triggered training DAG runs for every FEATURES (or EMBEDDINGS) event; ``decide`` says whether that run
trains. A training is due for the newest day D the triggering events name when all of these hold:

1. at least ``min_days`` days are ingested up to D (a model needs a train, a valid and a test day: the first
   day's event used to fail with "no train days left");
2. no later day has landed yet (a backfill is under way: the event of its newest day trains, once);
3. the last training used data through a day at least ``every_days`` before D — or ``reason_key`` (e.g. the
   user-model version the ranker's embeddings come from) differs from the last training's.

Otherwise the run is "nothing to do" (exit 4: the task is skipped with the reason as its note, and nothing
downstream runs). A finished training is recorded with ``record_training`` (``<ws>/schedule/<kind>.json``).
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

from gemflow.workspace import Workspace


@dataclass(frozen=True)
class TrainDue:
    kind: str  # user | ranker
    through: dt.date | None  # the newest day the triggering events name; None = the newest ingested
    min_days: int = 3
    every_days: int = 1
    reason_key: str = ""


@dataclass(frozen=True)
class Verdict:
    due: bool
    reason: str


def _days(folder) -> list[dt.date]:
    if not folder.exists():
        return []
    out = []
    for p in folder.glob("date=*"):
        try:
            out.append(dt.date.fromisoformat(p.name[5:]))
        except ValueError:
            continue
    return sorted(out)


def _record_path(ws: Workspace, kind: str):
    if kind not in ("user", "ranker"):
        raise ValueError(f"kind must be user or ranker, got {kind!r}")
    return ws.root / "schedule" / f"{kind}.json"


def last_training(ws: Workspace, kind: str) -> dict | None:
    path = _record_path(ws, kind)
    return json.loads(path.read_text()) if path.exists() else None


def decide(ws: Workspace, rule: TrainDue) -> Verdict:
    ingested = _days(ws.offline("events"))
    if not ingested:
        return Verdict(False, "no day has been ingested yet")
    through = rule.through or ingested[-1]
    upto = [d for d in ingested if d <= through]
    if len(upto) < rule.min_days:
        return Verdict(
            False,
            f"{len(upto)} day(s) ingested through {through}; a {rule.kind} model needs {rule.min_days} "
            f"(train + valid + test days)",
        )
    later = [d for d in _days(ws.raw("events")) if d > through]
    if later:
        return Verdict(
            False, f"a backfill is under way: {later[-1]} has landed after {through}; its event trains"
        )
    last = last_training(ws, rule.kind)
    if last is None:
        return Verdict(True, f"first {rule.kind} training: {len(upto)} ingested days through {through}")
    if rule.reason_key and rule.reason_key != last.get("reason_key", ""):
        return Verdict(
            True, f"{rule.reason_key!r} differs from the last training's {last.get('reason_key')!r}"
        )
    last_day = dt.date.fromisoformat(last["through"])
    age = (through - last_day).days
    if age < rule.every_days:
        return Verdict(
            False,
            f"the last {rule.kind} training used data through {last_day}; {through} is {age} day(s) later, "
            f"it retrains every {rule.every_days} day(s)",
        )
    return Verdict(
        True, f"the last {rule.kind} training used data through {last_day}, {age} day(s) before {through}"
    )


def record_training(ws: Workspace, kind: str, through: dt.date | None, reason_key: str = "") -> dict:
    ingested = _days(ws.offline("events"))
    day = through or (ingested[-1] if ingested else None)
    if day is None:
        raise ValueError("nothing ingested: no training to record")
    rec = {"through": day.isoformat(), "reason_key": reason_key,
           "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}  # fmt: skip
    path = _record_path(ws, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))
    return rec
