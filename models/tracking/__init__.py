"""Tracking: the MLflow store every run and model lives in, a training run's metrics and plots, and the model
registry (``registry/``: logging, gates, the pyfunc model)."""
