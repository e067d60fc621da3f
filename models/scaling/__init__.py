"""The scaling-law lab: grids of real training runs, exact FLOPs, NE-vs-compute fits and the experiments on top.

config.py       ScalingConfig: the preset (laptop / cluster YAML), axes, experiments, workers
grid.py         SweepPoint: one training run of the grid, keyed by the hash of everything that shapes it
composition.py  derived training sets whose histories keep only some action types (same examples)
flops.py        forward + backward FLOPs per training example, counted with FlopCounterMode
runner.py       a sweep: plan the grid, run its unfinished points, one MLflow parent run, the summary
point.py        one point's training, FLOPs and timing (resumable), and the process pool that runs many
fit.py          NE = a - b*log10(C) and NE = E + A*C^-alpha, R^2, 95% bands, the compute frontier
serving_cost.py the ranker's serving time per 1,000 candidates
report.py       per-axis fits, synergy, composition, tunability -> plots + a markdown summary
"""
