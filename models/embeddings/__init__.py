"""Cached user embeddings: the batch refresh from the champion user model into Feast, and version checks."""
