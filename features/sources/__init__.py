"""Event-log sources: each writes the raw contract of ``features.schema`` as day partitions.

- ``synthetic``: a seeded generator with planted structure (long/short-term interests, target-dependent labels);
- ``interactions``: the generic importer for any (user, item, time-or-order, label/rating, attributes) log;
- ``movielens``: MovieLens-100K converted through the generic importer;
- ``defects``: injects known defect classes so the validation gate can be tested against ground truth.

Heavy modules are imported by their callers, not here, so ``import features.sources`` stays cheap.
"""
