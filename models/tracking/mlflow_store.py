"""The MLflow store every run, model and artifact of the platform lives in: one place decides it.

Which tracking URI: an explicit one (a CLI option or ``tracking.tracking_uri``), else ``$MLFLOW_TRACKING_URI``
(what the cluster's pods are given), else the workspace's embedded store ``sqlite:///<ws.mlflow>/mlflow.db``.
Which artifact root: on a tracking server, the server's own (it proxies artifacts); otherwise
``<ws.mlflow>/artifacts``, never MLflow's fallback ``./mlruns`` of whatever directory a command ran in.

The embedded store is created with that root (so even the Default experiment lives under the workspace), and it
records the root its paths were written for. SQLite keeps artifact locations as absolute URIs, so a copied or
moved workspace would still read the old folder: ``open_store`` rewrites them to the workspace's current root the
first time it opens a moved store (``relocate``).
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from gemflow.workspace import Workspace

log = logging.getLogger(__name__)

ROOT_TAG = "gemflow.artifact_root"  # on the Default experiment (id 0): the root the stored paths point into
SERVER_SCHEMES = ("http://", "https://", "databricks")  # stores whose server owns the artifact root
# every column of MLflow's SQL schema that holds an artifact location (absent ones are skipped)
LOCATION_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
)


@dataclass(frozen=True)
class Store:
    tracking_uri: str
    artifact_root: str | None  # a file URI under the workspace; None = the tracking server's own root


def artifact_root(ws: Workspace) -> str:
    return (ws.mlflow / "artifacts").resolve().as_uri()


def embedded_uri(ws: Workspace) -> str:
    return f"sqlite:///{(ws.mlflow / 'mlflow.db').resolve()}"


def resolve(ws: Workspace, tracking_uri: str = "") -> Store:
    """The store for ``ws`` (see the module doc for the order), prepared for use when it is the embedded one."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri or uri == embedded_uri(ws):
        _note_other_ui(ws)
        return Store(open_embedded(ws), artifact_root(ws))
    return Store(uri, None if uri.startswith(SERVER_SCHEMES) else artifact_root(ws))


_noted: set[Path] = set()


def _note_other_ui(ws: Workspace) -> None:
    """One line per process when the MLflow UI of ``gemflow up`` shows another workspace's store than ``ws``'s
    (``gemflow.running_ui``); on the platform's own workspace the UI reads this very store, and nothing is said."""
    from gemflow import running_ui

    root = ws.root.resolve()
    ui = running_ui.running() if root not in _noted else None
    if ui is not None and ui.workspace != root:
        _noted.add(root)
        log.warning(
            "MLflow: this workspace's runs and models go to %s, not to the MLflow UI at %s, which shows the "
            "platform's workspace %s; to see them there, run the platform on this workspace (gemflow down -w %s; "
            "gemflow up -w %s), or browse them with gemflow mlflow-server -w %s --port 5001",
            ws.mlflow, ui.mlflow_url, ui.workspace, ui.workspace, root, root,
        )  # fmt: skip


def open_embedded(ws: Workspace) -> str:
    """Create the workspace's SQLite store if needed and point its paths at the workspace; returns its URI."""
    uri, root = embedded_uri(ws), artifact_root(ws)
    db = ws.mlflow / "mlflow.db"
    if not db.exists():
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        ws.mlflow.mkdir(parents=True, exist_ok=True)
        SqlAlchemyStore(uri, root)  # schema + the Default experiment, under <ws.mlflow>/artifacts/0
    relocate(db, root)
    return uri


def relocate(db: Path, root: str) -> str | None:
    """Point every stored artifact location recorded under another root at ``root``; returns the old root.

    A store with no record yet (new, or written before records) is taken to belong where it is.
    """
    with sqlite3.connect(db, timeout=60) as con:
        row = con.execute(
            "SELECT value FROM experiment_tags WHERE experiment_id = 0 AND key = ?", (ROOT_TAG,)
        ).fetchone()
        old = row[0] if row else None
        if old == root:
            return None
        if old is not None:
            for table, column in _present(con, LOCATION_COLUMNS):
                for before, after in ((old, root), (_path(old), _path(root))):
                    con.execute(
                        f"UPDATE {table} SET {column} = ? || substr({column}, ?) "  # noqa: S608 (fixed names)
                        f"WHERE substr({column}, 1, ?) = ? "
                        f"AND (length({column}) = ? OR substr({column}, ?, 1) = '/')",
                        (after, len(before) + 1, len(before), before, len(before), len(before) + 1),
                    )
            log.info("MLflow store %s moved: artifact locations %s -> %s", db, old, root)
        con.execute(
            "INSERT OR REPLACE INTO experiment_tags (key, value, experiment_id) VALUES (?, ?, 0)",
            (ROOT_TAG, root),
        )
    return old


def _path(uri: str) -> str:
    return uri.removeprefix("file://")


def _present(con: sqlite3.Connection, columns) -> list[tuple[str, str]]:
    out = []
    for table, column in columns:
        names = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
        if column in names:
            out.append((table, column))
    return out


# MLflow 3's UI opens an experiment without this tag in its GenAI view (traces, prompts); ours train models
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
# MLflow 3.17's UI also has a global GenAI / Model-training switch (GenAI unless the browser stored another
# choice); a link with this query opens the model-training view whatever the browser stored
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def ui_link(server_url: str, path: str = "/experiments") -> str:
    """A link into the MLflow UI at ``server_url`` that opens the model-training view."""
    return f"{server_url}/#{path}?{MODEL_TRAINING_VIEW}"


def experiment_id(client, name: str, store: Store) -> str:
    """The experiment ``name``, created with the store's artifact root when it does not exist yet, and tagged as
    model development (``EXPERIMENT_KIND``) so the UI opens its model-training view."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client.create_experiment(name, artifact_location=store.artifact_root, tags=EXPERIMENT_KIND)
        except MlflowException:  # created meanwhile by another process (a parallel sweep point)
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    for key, value in EXPERIMENT_KIND.items():
        if key not in experiment.tags:  # created before the tag was set
            try:
                client.set_experiment_tag(experiment.experiment_id, key, value)
            except MlflowException as err:  # an auth server: another user's experiment (a cosmetic tag)
                log.debug("experiment %s not tagged %s: %s", name, key, err)
    return experiment.experiment_id


def activate(tracking_uri: str) -> None:
    """Point this process's MLflow API at ``tracking_uri``. MLflow also exports the URI as ``$MLFLOW_TRACKING_URI``
    for subprocesses; that variable is put back, so that only the configured value (if any) is ever read from
    it and a later ``resolve`` for another workspace does not inherit this one's store."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    configured = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(tracking_uri)
    if configured is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = configured


def use(ws: Workspace, tracking_uri: str = "") -> Store:
    """``resolve`` + ``activate``: the store every MLflow call of this process then goes to."""
    store = resolve(ws, tracking_uri)
    activate(store.tracking_uri)
    return store


def unreachable(err: BaseException) -> bool:
    """Whether an MLflow call's error means the tracking server did not answer at all (refused, reset, timed out, or
    only 5xx until the client's retries ran out), as opposed to an answer such as "no such run". MLflow's REST
    client wraps the ``requests`` error in an ``MlflowException`` (as its cause or context)."""
    import requests

    down = (requests.exceptions.ConnectionError, requests.exceptions.Timeout, requests.exceptions.RetryError,
            ConnectionError)  # fmt: skip
    return any(isinstance(e, down) for e in _chain(err))


def unreachable_message(err: BaseException, tracking_uri: str) -> str:
    """One line for an ``unreachable`` error: the server, and why (e.g. "Connection refused", "ReadTimeout")."""
    text = " ".join(str(e) for e in _chain(err))
    why = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    kind = next((type(e).__name__ for e in _chain(err) if type(e).__module__.startswith("requests")), "")
    reason = why[1].strip() if why else kind or type(err).__name__
    return f"the MLflow tracking server {tracking_uri} did not answer ({reason})"


def _chain(err: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while err is not None and all(err is not e for e in out):
        out.append(err)
        err = err.__cause__ or err.__context__
    return out


def connect(ws: Workspace | None, tracking_uri: str = ""):
    """Point this process at ``ws``'s store (``tracking_uri`` if given) and return a client; without a workspace,
    at ``tracking_uri`` or whatever this process already uses."""
    import mlflow

    if ws is not None:
        use(ws, tracking_uri)
    elif tracking_uri:
        activate(tracking_uri)
    return mlflow.MlflowClient()
