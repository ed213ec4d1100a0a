"""One way to name a model everywhere (recipes, CLI, workers): a folder or `preset:NAME[@seed]`."""
from __future__ import annotations

from pathlib import Path

import torch

from ebpo.model.modeling_llada2_moe import LLaDA2MoeModelLM
from ebpo.model.presets import load_preset
from ebpo.model.tokenizer import load_tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
TINY_SFT_DIR = ASSETS / "tiny-sft"  # the tiny model trained by recipes/sft_tiny.yaml, shipped with the package
# checkpoints shipped with the package, by the name a recipe or the CLI gives them
SHIPPED_MODELS = {
    "tiny-sft": TINY_SFT_DIR,
    # tiny-sft fine-tuned on answers half of which skip the working (recipes/sft_tiny_mixed.yaml): the
    # RL quickstart's starting point
    "tiny-sft-mixed": ASSETS / "tiny-sft-mixed",
    # tiny-sft with DELETE / INSERT named and fine-tuned with Levenshtein rounds (recipes/sft_tiny_lev.yaml)
    "tiny-sft-lev": ASSETS / "tiny-sft-lev",
    # tiny-sft fine-tuned on calculator-tool trajectories (recipes/sft_tiny_agent.yaml): the agentic task's
    # starting point (docs/training.md)
    "tiny-agent": ASSETS / "tiny-agent",
    # tiny-sft fine-tuned on reasoning-gym's basic_arithmetic questions with worked answers
    # (recipes/sft_tiny_reasoning_gym.yaml): the reasoning-gym RL recipe's starting point
    "tiny-sft-rg": ASSETS / "tiny-sft-rg",
    # tiny-agent fine-tuned, with Levenshtein rounds (DELETE / INSERT named), on code-repair trajectories with the
    # run_tests tool (recipes/sft_tiny_code_agent.yaml): the LLaDA2.2 agent quickstart's starting point
    "tiny-code-agent": ASSETS / "tiny-code-agent",
}


def resolve_model_path(spec: str) -> str:
    """A shipped name (`tiny-sft`, `tiny-sft-mixed`) -> its checkpoint folder; a folder or `preset:...` spec
    is returned unchanged."""
    if spec in SHIPPED_MODELS:
        folder = SHIPPED_MODELS[spec]
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"the shipped checkpoint {spec!r} is missing at {folder}")
        return str(folder)
    return spec


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LLaDA2MoeModelLM:
    """Load a model from a folder (`save_pretrained` layout), a shipped name (`tiny-sft`, `tiny-sft-mixed`),
    or `preset:NAME[@seed]` (random init).

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
        raise FileNotFoundError(f"model {spec!r} is neither a folder, a shipped name "
                                f"({', '.join(sorted(SHIPPED_MODELS))}), nor 'preset:NAME[@seed]'")
    return LLaDA2MoeModelLM.from_pretrained(spec, dtype=dtype).to(device)


def load_model_tokenizer(spec: str):
    """The tokenizer saved with a model folder, else the project's character tokenizer."""
    spec = resolve_model_path(spec)
    if not spec.startswith("preset:") and (Path(spec) / "tokenizer.json").exists():
        return load_tokenizer(spec)
    return load_tokenizer()
