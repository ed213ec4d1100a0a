"""Shared infrastructure for the training floors: typed config loading (`config`), dataset rows (`data`),
metrics and W&B (`tracking`), checkpoints (`checkpoint`), plots (`plots`), process groups (`distributed`).
Imports `ebpo.model` and `ebpo.core` at most; never `rollout` or `rewards`."""
