"""One way to name a model everywhere (recipes, CLI, workers): a folder or `preset:NAME[@seed]`."""
from __future__ import annotations

from pathlib import Path

import torch

from .modeling_llada2_moe import LLaDA2MoeModelLM
from .presets import load_preset
from .tokenizer import load_tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_SFT_DIR = ASSETS / "tiny-sft"  # the tiny model trained by recipes/sft_tiny.yaml, shipped with the package


def resolve_model_path(spec: str) -> str:
    """`tiny-sft` -> the shipped checkpoint folder; a folder or `preset:...` spec is returned unchanged."""
    if spec == "tiny-sft":
        if not (TINY_SFT_DIR / "config.json").exists():
            raise FileNotFoundError(f"the shipped tiny checkpoint is missing at {TINY_SFT_DIR}")
        return str(TINY_SFT_DIR)
    return spec


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LLaDA2MoeModelLM:
    """Load a model from a folder (`save_pretrained` layout), `tiny-sft`, or `preset:NAME[@seed]` (random init).

    A preset is initialised from an explicit generator-free seed scope (`torch.random.fork_rng`) so that
    naming the same spec twice gives the same weights without touching the caller's global RNG state.
    """
    spec = resolve_model_path(spec)
    if spec.startswith("preset:"):
        name, _, seed = spec[len("preset:"):].partition("@")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed or 0))
            model = LLaDA2MoeModelLM(load_preset(name))
        return model.to(device=device, dtype=dtype)
    if not Path(spec).is_dir():
        raise FileNotFoundError(f"model {spec!r} is neither a folder, 'tiny-sft', nor 'preset:NAME[@seed]'")
    return LLaDA2MoeModelLM.from_pretrained(spec, dtype=dtype).to(device)


def load_model_tokenizer(spec: str):
    """The tokenizer saved with a model folder, else the project's character tokenizer."""
    spec = resolve_model_path(spec)
    if not spec.startswith("preset:") and (Path(spec) / "tokenizer.json").exists():
        return load_tokenizer(spec)
    return load_tokenizer()
