"""Jagged attention: a plain PyTorch reference and fast backends behind one dispatcher per op."""
