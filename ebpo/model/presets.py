"""Named model presets (`ebpo/presets/*.json`): `tiny` for tests and the quickstart, `mini`, `flash`."""
from __future__ import annotations

import json
from pathlib import Path

from ebpo.model.configuration_llada2_moe import LLaDA2MoeConfig

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"


def preset_names() -> list[str]:
    """Names of the shipped presets."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def load_preset(name: str, **overrides) -> LLaDA2MoeConfig:
    """Config of preset `name` with keyword overrides; unknown names list the choices."""
    path = PRESET_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"model preset {name!r} not found; choose one of {preset_names()}")
    fields = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    fields.update(overrides)
    return LLaDA2MoeConfig(**fields)


def tiny_config(**overrides) -> LLaDA2MoeConfig:
    """The tiny preset (about 1M parameters, block 8, vocabulary of `ebpo.model.tokenizer`)."""
    return load_preset("tiny", **overrides)
