"""gemflow: multi-stage ads ranking (offline user model + online ranker) as a runnable MLOps platform."""

__version__ = "0.1.0"
