"""Rollout engine: batched draft-and-edit decoding (LLaDA2.1 joint thresholds) with a prefix KV cache.

    from rollout import DecodeConfig, generate
    outs = generate(model, [[0, 17, 42]], DecodeConfig.preset("quality", max_new_tokens=64))

See docs/decoding.md. `rollout.steps` holds the pure step functions, `rollout.decoder` the batched loop,
`rollout.config` the settings, `rollout.cli` the `ebpo generate` command.
"""
from .config import PRESETS, DecodeConfig
from .decoder import GenerationOutput, StepEvent, generate

__all__ = ["DecodeConfig", "GenerationOutput", "PRESETS", "StepEvent", "generate"]
