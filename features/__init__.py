"""Data plane: event-log sources, validation gate, Feast feature repo, ingestion and training sets."""

from features.feast_import import defer_feast_torch_import, skip_typeguard_instrumentation

skip_typeguard_instrumentation()  # before any module here imports feast
defer_feast_torch_import()
