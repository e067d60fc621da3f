"""Data plane: event-log sources, validation gate, Feast feature repo, ingestion and training sets."""
