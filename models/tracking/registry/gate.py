"""The champion/challenger gate: a new version is promoted only if it beats the champion on the same held-out set.

Aliases, not stages (deprecated since MLflow 2.9): every new version becomes ``@challenger``; the gate moves
``@champion`` only when NE improves by a set relative margin and calibration stays in bounds. Each decision and
its figures are logged as params and metrics of the version's logged model (MLflow 3 LoggedModel, in its source
run: searchable and comparable across models), and as version tags for the registry UI, so the registry itself
explains why a version is (not) serving. Next-item
models (positive-only logs) have no NE: they are compared on leave-one-out NDCG@10, with no calibration bound.

The gate is safe to run again on a version (a retried registration reuses its version): a version that is
already ``@champion`` is judged again against the champion it replaced (its ``gate.previous_champion`` tag, or
none), which gives the first run's decision, and no alias moves but the removal of a ``@challenger`` the first
run left on it; a version gated before and not promoted is compared with the current champion again.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

log = logging.getLogger(__name__)

CHAMPION, CHALLENGER = "champion", "challenger"
LOGGED_MODEL_SOURCE = re.compile(r"^models:/(m-[0-9a-f]+)$")
Evaluate = Callable[
    [str], dict[str, float]
]  # model URI -> {"ne": ..., "calibration": ..., ...} on held-out data


@dataclass
class GateConfig:
    min_relative_ne_gain: float = 0.002  # challenger NE <= champion NE * (1 - gain)
    calibration_low: float = 0.8  # mean prediction / observed rate
    calibration_high: float = 1.25
    # next-item models (positive-only logs, no NE): challenger NDCG@10 >= champion NDCG@10 * (1 + gain)
    min_relative_ndcg_gain: float = 0.002


@dataclass
class GateDecision:
    name: str
    version: str
    promoted: bool
    reason: str
    champion_version: str | None
    metrics: dict[str, float] = field(default_factory=dict)
    champion_metrics: dict[str, float] = field(default_factory=dict)


def champion_version(client: MlflowClient, name: str) -> str | None:
    return _alias_version(client, name, CHAMPION)


def decide(metrics: dict[str, float], champion: dict[str, float] | None, cfg: GateConfig) -> tuple[bool, str]:
    if "ne" not in metrics:
        return _decide_ranking(metrics, champion, cfg)
    cal = metrics["calibration"]
    if not cfg.calibration_low <= cal <= cfg.calibration_high:
        return False, f"calibration {cal:.3f} outside [{cfg.calibration_low}, {cfg.calibration_high}]"
    if champion is None:
        return True, "no champion yet"
    needed = champion["ne"] * (1.0 - cfg.min_relative_ne_gain)
    if metrics["ne"] > needed:
        return (
            False,
            f"NE {metrics['ne']:.5f} does not beat champion {champion['ne']:.5f} (needs <= {needed:.5f})",
        )
    return True, f"NE {metrics['ne']:.5f} beats champion {champion['ne']:.5f}"


def _decide_ranking(metrics: dict[str, float], champion: dict[str, float] | None, cfg: GateConfig):
    """Next-item models are judged by leave-one-out NDCG@10 (99 sampled negatives): higher is better."""
    if "ndcg@10" not in metrics:
        raise ValueError(
            f"the gate needs 'ne' (click models) or 'ndcg@10' (next-item models), got {sorted(metrics)}"
        )
    if champion is None:
        return True, "no champion yet"
    if "ndcg@10" not in champion:
        return False, "the champion is a click model and the challenger a next-item model: not comparable"
    needed = champion["ndcg@10"] * (1.0 + cfg.min_relative_ndcg_gain)
    if metrics["ndcg@10"] < needed:
        return False, (
            f"NDCG@10 {metrics['ndcg@10']:.5f} does not beat champion {champion['ndcg@10']:.5f} (needs >= {needed:.5f})"
        )
    return True, f"NDCG@10 {metrics['ndcg@10']:.5f} beats champion {champion['ndcg@10']:.5f}"


def run_gate(
    name: str,
    version: str,
    evaluate: Evaluate,
    cfg: GateConfig | None = None,
    client: MlflowClient | None = None,
) -> GateDecision:
    cfg = cfg or GateConfig()
    client = client or MlflowClient()
    version = str(version)
    current = champion_version(client, name)
    rerun = current == version  # an earlier run promoted it (and maybe died before it finished)
    if rerun:
        compared = client.get_model_version(name, version).tags.get("gate.previous_champion")
        log.info("%s v%s is already @champion: judged again against %s, no alias moves",
                 name, version, f"v{compared}" if compared else "no champion")  # fmt: skip
    else:
        client.set_registered_model_alias(name, CHALLENGER, version)  # a no-op when a re-run finds it there
        compared = current
    metrics = evaluate(f"models:/{name}/{version}")
    champion = evaluate(f"models:/{name}/{compared}") if compared else None
    promoted, reason = decide(metrics, champion, cfg)
    decision = GateDecision(name, version, promoted, reason, compared, metrics, champion or {})

    tags = {"gate.decision": "promoted" if promoted else "rejected", "gate.reason": reason}
    tags |= {f"gate.{k}": f"{v:.6g}" for k, v in metrics.items()}
    if champion:
        tags |= {"gate.compared_to": compared} | {
            f"gate.champion_{k}": f"{v:.6g}" for k, v in champion.items()
        }
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, value)
    log_on_model(client, decision)
    if promoted and not rerun:
        if current:
            client.set_model_version_tag(name, version, "gate.previous_champion", current)
        client.set_registered_model_alias(name, CHAMPION, version)
        client.delete_registered_model_alias(name, CHALLENGER)
    elif promoted and _alias_version(client, name, CHALLENGER) == version:  # left by a run that died here
        client.delete_registered_model_alias(name, CHALLENGER)
    elif (
        rerun
    ):  # not promoted this time (the held-out figures changed?): the gate never demotes, rollback does
        log.warning("%s v%s stays @champion although the gate now rejects it: %s", name, version, reason)
    return decision


def _alias_version(client: MlflowClient, name: str, alias: str) -> str | None:
    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def logged_model_id(mv) -> str | None:
    """The LoggedModel behind a model version. SQL registries leave ``ModelVersion.model_id`` empty; the
    version's source is then ``models:/<model id>``."""
    match = LOGGED_MODEL_SOURCE.match(mv.source or "")
    return mv.model_id or (match[1] if match else None)


def log_on_model(client: MlflowClient, decision: GateDecision) -> None:
    """The decision (params) and its figures (metrics, ``gate.promoted`` 1/0) on the version's logged model."""
    mv = client.get_model_version(decision.name, decision.version)
    model_id = logged_model_id(mv)
    if not model_id or not mv.run_id:
        raise ValueError(
            f"{decision.name} v{decision.version} was not logged as a model in a run: no lineage"
        )
    figures = {f"gate.{k}": v for k, v in decision.metrics.items()}
    figures |= {f"gate.champion_{k}": v for k, v in decision.champion_metrics.items()}
    figures["gate.promoted"] = float(decision.promoted)
    now = int(time.time() * 1000)
    metrics = [Metric(k, float(v), now, 0, model_id=model_id) for k, v in figures.items()]
    client.log_batch(mv.run_id, metrics=metrics)
    params = {"gate.decision": "promoted" if decision.promoted else "rejected",
              "gate.reason": decision.reason, "gate.compared_to": decision.champion_version if decision.champion_metrics else "none"}  # fmt: skip
    # a logged model's params cannot change (MLflow rejects a key it already has): a re-run logs only new ones
    logged = client.get_logged_model(model_id).params
    changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
    if changed:
        log.warning("logged model %s keeps its first gate params %s; the version tags hold this run's", model_id,
                    changed)  # fmt: skip
    if fresh := {k: v for k, v in params.items() if k not in logged}:
        client.log_model_params(model_id, fresh)


def rollback(name: str, client: MlflowClient | None = None) -> str:
    """Move ``@champion`` back to the version it replaced; returns that version."""
    client = client or MlflowClient()
    current = champion_version(client, name)
    if current is None:
        raise ValueError(f"{name} has no @champion to roll back")
    previous = client.get_model_version(name, current).tags.get("gate.previous_champion")
    if not previous:
        raise ValueError(
            f"{name}@champion (version {current}) replaced no earlier champion: nothing to roll back to"
        )
    client.set_registered_model_alias(name, CHAMPION, previous)
    client.set_model_version_tag(name, current, "gate.rolled_back", "true")
    return previous
