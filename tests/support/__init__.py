"""Shared test support: stub models (`models`), Ray run helpers (`ray_runs`, `async_runs`), device checks
(`devices`) and plain references (`lev_reference`). Test modules import what they need from here; fixtures that
every folder wants live in tests/conftest.py."""
