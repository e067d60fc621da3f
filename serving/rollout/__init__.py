"""Rolling the online ranker out: deploy -> smoke test -> promote, or roll back.

One protocol (``base.Rollout``), two implementations:
- ``local.LocalRollout``: ``gemflow serve`` in the background (pid file + log under ``<ws>/serving/``); a laptop
  has no traffic split, so the new version takes all traffic at once and "promote" only records it as live;
- ``cluster.ClusterRollout``: the deployer owns the ranker's InferenceService (Knative mode): it applies the
  manifest with the model pinned, smoke-tests the canary revision through its own ``latest-`` URL, then moves
  ``canaryTrafficPercent`` to 100 (promote) or 0 (roll back: KServe routes everything to the previous ready
  revision). The Helm chart ships its manifest as data (the ranker-manifest ConfigMap, mounted into stage
  pods) and never creates the object, so a ``helm upgrade`` cannot revert a rollout (``isvc``).

The model is pinned at deploy time (``models:/gem-ranker/7``, never the alias), and the version the smoke test
expects is ``version.served_version`` of that pin: the label ``gemflow serve`` reports for it, one string for
deployer and server. ``<ws>/serving/deploy.json`` (``state``) records what is live and what it replaced.
"""
