"""Shared test support: stub models (`models`), Ray run helpers (`ray_runs`, `async_runs`), device checks (`devices`),
plain references (`lev_reference`, `decode_reference`: the one-sequence draft-and-edit loop) and the rollout
engine's stub model with its reference decoder (`stub_engine_model`). Test modules import what they need from here;
fixtures that every folder wants live in tests/conftest.py."""
