"""The exit codes Airflow reads are the CLI's: ``dags/gemflow_stage.py`` (which runs in the Airflow image, without
the project package) repeats two numbers of ``gemflow.exit_codes``; this pins them together."""

from __future__ import annotations

import ast

from gemflow import exit_codes
from tests.dags.airflow_env import DAGS


def _constants(path) -> dict[str, int]:
    tree = ast.parse(path.read_text())
    return {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }


def test_the_dags_exit_codes_are_the_clis():
    dag_side = _constants(DAGS / "gemflow_stage.py")
    assert dag_side["GATE_FAILED_EXIT"] == exit_codes.GATE_FAILED
    assert dag_side["UNCHANGED_EXIT"] == exit_codes.UNCHANGED


def test_the_commands_use_the_shared_codes():
    from gemflow.commands import deploy, ingest, refresh

    assert ingest.GATE_FAILED_EXIT == exit_codes.GATE_FAILED
    assert refresh.UNCHANGED_EXIT == exit_codes.UNCHANGED
    assert len({exit_codes.OK, exit_codes.FAILED, exit_codes.BAD_INPUT, exit_codes.GATE_FAILED,
                exit_codes.UNCHANGED}) == 5  # fmt: skip
    assert (deploy.FAILED_EXIT, deploy.BAD_INPUT_EXIT) == (exit_codes.FAILED, exit_codes.BAD_INPUT)
