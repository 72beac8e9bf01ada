"""Checkpoints: one file with a digest, sharded directories, consolidation, state dicts and RNG state."""
