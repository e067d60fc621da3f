"""Inference: loading a trained bundle and running it, and the serving fast path (the one-user scorer, oneDNN
linears, compiled dense work, row-bucketed GEMMs, gemflow's C++ kernels in ``native/``)."""
