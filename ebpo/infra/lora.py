"""The PEFT LoRA section, one spelling for CPT/SFT recipes (`lora.*`) and RL recipes (`learner.lora.*`).

    lora: {enabled: true, r: 16, alpha: 32, dropout: 0.0, target_modules: [...]}

LoRA wraps `nn.Linear` modules only: attention (`query_key_value`, `dense`), the dense MLP of the first
layers and the shared experts; routed experts are stacked `nn.Parameter`s and stay frozen.
"""
from __future__ import annotations

from dataclasses import dataclass

from peft import LoraConfig

from ebpo.infra.config import doc

LORA_TARGETS = ["query_key_value", "dense", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraSection:
    enabled: bool = doc("train a PEFT LoRA adapter instead of all weights", False)
    r: int = doc("LoRA rank", 16)
    alpha: float = doc("LoRA alpha (the adapter's output is scaled by alpha / r)", 32.0)
    dropout: float = doc("LoRA dropout", 0.0)
    target_modules: list[str] = doc("module names to adapt", default_factory=lambda: list(LORA_TARGETS))

    def validate(self):
        if self.r < 1:
            raise ValueError(f"r: must be >= 1 (got {self.r!r})")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: must lie in [0, 1) (got {self.dropout!r})")
        if not self.target_modules:
            raise ValueError("target_modules: name at least one module")

    def peft_config(self) -> LoraConfig:
        """The PEFT configuration of this section (bias untouched)."""
        return LoraConfig(r=self.r, lora_alpha=self.alpha, target_modules=list(self.target_modules),
                          lora_dropout=self.dropout, bias="none")
