"""Documented dataclass fields: the one helper the configuration dataclasses of every floor share.

It lives in the lowest floor that declares configuration (`ebpo.core` holds `ObjectiveConfig`), so that
pure modules can document their settings without importing the configuration loader above them.
"""
from __future__ import annotations

import dataclasses
from typing import Any


def doc(help: str, default: Any = dataclasses.MISSING, default_factory: Any = dataclasses.MISSING):
    """A dataclass field with its documentation attached (shown by `describe`)."""
    kwargs = {"metadata": {"help": help}}
    if default is not dataclasses.MISSING:
        kwargs["default"] = default
    if default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = default_factory
    return dataclasses.field(**kwargs)
