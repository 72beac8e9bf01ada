"""The launcher over torchrun: its configuration, supervision, the worker script, failure summaries."""
