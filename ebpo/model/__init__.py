"""LLaDA2.x MoE block-diffusion model, presets and the project's small tokenizer."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from ebpo.model.cache import BlockKVCache
from ebpo.model.configuration_llada2_moe import LLaDA2MoeConfig
from ebpo.model.modeling_llada2_moe import (LLaDA2MoeModel, LLaDA2MoeModelLM, LLaDA2MoeOutput,
                                             enable_activation_checkpointing)
from ebpo.model.presets import load_preset, preset_names, tiny_config

AutoConfig.register("llada2_moe", LLaDA2MoeConfig, exist_ok=True)
AutoModel.register(LLaDA2MoeConfig, LLaDA2MoeModel, exist_ok=True)
AutoModelForCausalLM.register(LLaDA2MoeConfig, LLaDA2MoeModelLM, exist_ok=True)

__all__ = ["BlockKVCache", "LLaDA2MoeConfig", "LLaDA2MoeModel", "LLaDA2MoeModelLM", "LLaDA2MoeOutput",
           "enable_activation_checkpointing", "load_preset", "preset_names", "tiny_config"]
