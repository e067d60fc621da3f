"""The GEM model family, by job: ``architectures`` (tokenizer, layers, user model, ranker) with ``attention`` beside
them, ``training``, ``inference`` (bundles and the serving fast path), ``tracking`` (MLflow and the registry);
``sequential`` (the next-item tasks and baselines), ``embeddings`` (the refresh), ``scaling`` (the scaling lab)."""
