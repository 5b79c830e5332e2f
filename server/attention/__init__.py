"""Attention backends, below `engine/` and `models/`: the interface both see, selection by name, one module each."""
