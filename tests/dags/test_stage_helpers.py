"""``dags/gemflow_stage`` helpers in the Airflow environment: a run acts on what its triggering events name
(``event_value``), empty optional values drop with their flag, and stage output keeps each line's level."""

from __future__ import annotations

from tests.dags.airflow_env import DAGS, airflow_env, require_airflow, run_airflow_python

CODE = f"""
import json, logging, sys
sys.path.insert(0, {str(DAGS)!r})
import jinja2
from gemflow_stage import StageOutput, _drop_empty, event_value

class Event:
    def __init__(self, extra): self.extra = extra

env = jinja2.Environment(undefined=jinja2.StrictUndefined)
def render(expr, **ctx):
    return env.from_string(expr).render(params={{"through": "", "run_dir": "/manual"}}, **ctx)

events = {{"gemflow.features": [Event({{"day": "2026-03-02"}}), Event({{"day": "2026-03-03"}}), Event({{}})]}}
out = {{
    "max_day": render(event_value("day", "params.through"), triggering_asset_events=events),
    "min_day": render(event_value("day", "params.through", "min"), triggering_asset_events=events),
    "no_event": render(event_value("day", "params.through"), triggering_asset_events={{}}),
    "no_context": render(event_value("run_dir", "params.run_dir")),
    "dropped": _drop_empty(["ingest", "--date", "", "--skip-without-champion", "--run-dir", "  ", "x"]),
}}

records = []
class Keep(logging.Handler):
    def emit(self, r): records.append((r.levelname, r.getMessage()))
log = logging.getLogger("gemflow.stage")
log.addHandler(Keep()); log.setLevel(logging.DEBUG); log.propagate = False
s = StageOutput("stage")
for line in ["2026-12-01 16:26:01,123 INFO models.training.train: epoch 1", "2026-12-01 16:26:01,124 WARNING feast: slow",
             "[rank0]:W1201 16:27:58.585000 1 x.py:5] hmm", "x/trainer.py:187: UserWarning: detach",
             "Traceback (most recent call last):", '  File "t.py", line 1', "ValueError: bad", "plain progress",
             "error: no such day", "step 3\\rstep 4"]:
    s.line(line + "\\n")
out["levels"] = records
print(json.dumps(out))
"""


def test_event_values_drop_empty_and_levels(tmp_path):
    require_airflow()
    out = run_airflow_python(CODE, airflow_env(tmp_path))
    assert out["max_day"] == "2026-03-03" and out["min_day"] == "2026-03-02"
    assert out["no_event"] == "" and out["no_context"] == "/manual"  # a manual run takes the params
    assert out["dropped"] == ["ingest", "--skip-without-champion", "x"]
    assert [lvl for lvl, _ in out["levels"]] == [
        "INFO", "WARNING", "WARNING", "WARNING", "ERROR", "ERROR", "ERROR", "INFO", "ERROR", "INFO",
    ]  # fmt: skip
    assert out["levels"][-1][1] == "step 4"  # a progress bar's last redraw
