"""Rollout engine: continuous-batching draft-and-edit decoding (LLaDA2.1 joint thresholds) with a prefix KV cache.

    from rollout import DecodeConfig, generate
    outs = generate(model, [[0, 17, 42]], DecodeConfig.preset("quality", max_new_tokens=64))

See docs/decoding.md. `rollout.engine` is the one decode loop (a continuous-batching scheduler) that every
rollout path uses: `rollout.decoder.generate` (single-turn), `rollout.multiturn` (environments); `rollout.steps`
and `rollout.levenshtein` hold the pure step functions, `rollout.config` the settings, `rollout.cli` the
`ebpo generate` command.
"""
from .config import PRESETS, DecodeConfig
from .decoder import GenerationOutput, StepEvent, generate

__all__ = ["DecodeConfig", "GenerationOutput", "PRESETS", "StepEvent", "generate"]
