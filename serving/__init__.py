"""Online ranker serving: the KServe predictor, its request schema, limits, ad table and manifests."""
