"""The tests of rollout/engine.py, many: a folder (files named after what they check)."""
