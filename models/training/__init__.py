"""Training: training-set batches, the one loop, the single-process and distributed (``distributed/``) strategies,
evaluation and its metrics (the leave-one-out protocol stated once), and the end of a run."""
