"""Deterministic synthetic tasks for the tiny model (see `examples/tasks/generate.py`)."""
