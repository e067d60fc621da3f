"""Exit codes of the ``gemflow`` commands, one table for every command.

Airflow reads two of them (``dags/gemflow_stage.py``): ``GATE_FAILED`` fails the task without retries (bad data
stays bad), ``UNCHANGED`` skips it (its outlets publish nothing). The DAG files run in the Airflow image, which
does not have this package, so ``gemflow_stage`` repeats those two numbers; ``tests/dags/test_exit_codes.py``
pins both sides together.
"""

from __future__ import annotations

OK = 0
FAILED = 1  # the step ran and failed (smoke test, rollback, version mismatch, training error)
BAD_INPUT = 2  # bad arguments, config or missing inputs
GATE_FAILED = 3  # the validation gate rejected the data partition
UNCHANGED = 4  # nothing to do: e.g. the registry gate kept the current champion
