"""MLflow model registry: pickle-free model logging, the champion/challenger gate, rollback, the tracking server."""

from models.registry.gate import GateConfig, GateDecision, rollback, run_gate
from models.registry.logging import LoggedModel, load_torch_model, log_torch_model

__all__ = [
    "GateConfig",
    "GateDecision",
    "LoggedModel",
    "load_torch_model",
    "log_torch_model",
    "rollback",
    "run_gate",
]
