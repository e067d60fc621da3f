"""MLflow model registry: pickle-free model logging, the champion/challenger gate, rollback, the tracking server."""

from models.tracking.registry.gate import (
    CHALLENGER,
    CHAMPION,
    GateConfig,
    GateDecision,
    champion_version,
    rollback,
    run_gate,
)
from models.tracking.registry.logging import (
    REGISTERED_NAMES,
    RegisteredVersion,
    load_registered,
    register_bundle,
)

__all__ = [
    "CHALLENGER",
    "CHAMPION",
    "REGISTERED_NAMES",
    "GateConfig",
    "GateDecision",
    "RegisteredVersion",
    "champion_version",
    "load_registered",
    "register_bundle",
    "rollback",
    "run_gate",
]
