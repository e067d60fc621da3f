"""The validation gate between landed raw partitions and the offline store (great-expectations 1.x).

``validate_partition`` splits a raw partition into accepted rows (exact contract types) and quarantined rows
(each with the expectation it failed), writes GX data docs and a JSON summary, and raises
``ValidationGateError`` when the partition as a whole must not be loaded.
"""

from features.validation.gate import GateConfig, GateResult, ValidationGateError, validate_partition
from features.validation.suites import EVENT_DEFECT_REASONS

__all__ = ["EVENT_DEFECT_REASONS", "GateConfig", "GateResult", "ValidationGateError", "validate_partition"]
