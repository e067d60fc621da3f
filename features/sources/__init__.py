"""Event-log sources: each writes the raw contract of ``features.schema`` as day partitions.

- ``synthetic``: a seeded generator with planted structure (long/short-term interests, target-dependent labels);
  its fixed world in ``synthetic_world``, one day's events of a user chunk in ``synthetic_events``;
- ``interactions``: the generic importer for any (user, item, time-or-order, label/rating, attributes) log;
  its format in ``interaction_format``, row checks ``interaction_rows``, columns -> events
  ``interaction_columns``, ads/users tables ``interaction_entities``;
- ``movielens``: MovieLens-100K converted through the generic importer;
- ``defects``: injects known defect classes so the validation gate can be tested against ground truth.

Heavy modules are imported by their callers, not here, so ``import features.sources`` stays cheap.
"""
