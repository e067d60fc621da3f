"""The data plane's Spark engine (``engine: spark``): the same stages as the embedded pandas/pyarrow engine,
on Apache Spark DataFrames, for logs too large for one process. Imported only when a config picks it."""
