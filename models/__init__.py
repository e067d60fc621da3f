"""The GEM model family: dense tokenization, jagged attention, offline user model, online ranker, metrics."""
