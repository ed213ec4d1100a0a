"""Typed configuration of a CPT/SFT recipe: `ebpo train recipes/{sft,cpt}_*.yaml key=value ...`.

Sections: `model`, `data`, `objective` (`ebpo.core.objectives.ObjectiveConfig`), `optim`, `lora`, `eval`,
`lev_draft` (the decoder rules of the Levenshtein rounds' next drafts), `trainer`.
`ebpo train recipes/sft_tiny.yaml --help` lists every key with its documentation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Union

from ebpo.infra.lora import LoraSection  # noqa: F401 (the `lora` section; re-exported)
from ebpo.infra.config import doc
from ebpo.core.objectives import ObjectiveConfig

if TYPE_CHECKING:
    from rollout.config import DecodeConfig


@dataclass
class SFTDataConfig:
    train: Union[str, list[str]] = doc("training rows: .jsonl/.json/.parquet/hf:PATH[:split], or a list of them",
                                       "examples/data/math_train.jsonl")
    eval: Union[str, list[str], None] = doc("held-out rows for periodic evaluation (null = none)", None)
    prompt_field: str = doc("SFT: row field with the user prompt", "prompt")
    response_field: str = doc("SFT: row field with the reference completion", "response")
    text_field: str = doc("CPT: row field with the document text", "text")
    multi_turn: bool = doc("SFT: rows are chat conversations with tool calls (data.messages_field); loss on the "
                           "assistant turns only, each turn padded to a block boundary (ebpo/sft/multiturn.py)", False)
    messages_field: str = doc("SFT with multi_turn: row field with the list of {role, content} messages", "messages")
    chat_template: bool = doc("SFT: wrap prompts in the tokenizer's chat template", True)
    max_len: int = doc("SFT: longest prompt+response in tokens; CPT: packed chunk length", 256)
    max_prompt_tokens: int = doc("SFT: longer prompts are cut from the left", 192)
    shuffle: bool = doc("reshuffle the rows every epoch (seeded by trainer.seed)", True)
    bucket: int = doc("length bucketing: sort this many batches' worth of rows by length (1 = off)", 8)

    def validate(self):
        if self.max_len <= 0 or self.max_prompt_tokens <= 0:
            raise ValueError("data.max_len / data.max_prompt_tokens: must be positive")


@dataclass
class OptimConfig:
    lr: float = doc("peak learning rate (AdamW)", 1e-3)
    weight_decay: float = doc("AdamW weight decay", 0.01)
    beta1: float = doc("AdamW beta1", 0.9)
    beta2: float = doc("AdamW beta2", 0.95)
    warmup_steps: int = doc("linear warmup from 0 to lr over this many optimizer steps", 50)
    min_lr_ratio: float = doc("cosine decay ends at lr * min_lr_ratio at trainer.steps", 0.1)
    grad_clip: float = doc("max global gradient norm (0 = no clipping)", 1.0)
    grad_accum: int = doc("micro-batches per optimizer step", 1)

    def validate(self):
        if self.lr <= 0:
            raise ValueError("optim.lr: must be positive")
        if self.grad_accum < 1:
            raise ValueError("optim.grad_accum: must be >= 1")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("optim.min_lr_ratio: must lie in [0, 1]")


@dataclass
class EvalSection:
    every: int = doc("evaluate every k steps (and at the end); 0 = only at the end", 0)
    size: int = doc("held-out rows used (0 = all)", 0)
    presets: list[str] = doc("decode presets to report (quality, speed, m2t, speed_noedit)",
                             default_factory=lambda: ["quality"])
    decode: dict = doc("DecodeConfig overrides, e.g. {max_new_tokens: 48}", default_factory=dict)
    batch_size: int = doc("prompts decoded together", 64)
    loss_rows: int = doc("held-out rows for the fixed-noise eval loss (0 = off)", 256)


# the DecodeConfig fields that `lev_draft.decode` may set: the others (max_new_tokens, sampling, MBE, ...) do not
# change one greedy block step, and a key that would be silently ignored is refused instead
DRAFT_DECODE_KEYS = ("tau_mask", "tau_edit", "num_to_transfer")


@dataclass
class LevDraftSection:
    preset: Optional[str] = doc(
        "decoder rules for the next Levenshtein round's draft (objective.lev_rounds >= 2; ebpo/sft/lev_draft.py): "
        "the decode preset (quality, speed, m2t) whose tau_mask / tau_edit / num_to_transfer it applies, with "
        "tau_delete / tau_insert / max_lev_edits below; null = the model's argmax at every editable position "
        "(earlier releases: every position rewritten, every DELETE / INSERT argmax applied)", "quality")
    tau_delete: Optional[float] = doc("p(DELETE) threshold of the draft (the decoder's tau_delete; strict); null or "
                                      "negative = no DELETE", 0.5)
    tau_insert: Optional[float] = doc("p(INSERT) threshold of the draft (the decoder's tau_insert; strict); null or "
                                      "negative = no INSERT", 0.5)
    max_lev_edits: int = doc("at most this many DELETE / INSERT per block of the draft (the most confident; the "
                             "decoder's max_lev_edits)", 2)
    decode: dict = doc(f"overrides of the preset's {', '.join(DRAFT_DECODE_KEYS)} (DecodeConfig fields), e.g. "
                       "{tau_edit: 0.3}", default_factory=dict)

    def decode_config(self) -> Optional[DecodeConfig]:
        """The `DecodeConfig` whose thresholds build the draft, or None (argmax draft). Raises ValueError naming
        the `lev_draft` key that is unknown or out of range."""
        from rollout.config import PRESETS, DecodeConfig  # only where a recipe has the section checked

        if self.preset is None:
            return None
        if self.preset not in PRESETS:
            raise ValueError(f"lev_draft.preset: unknown preset {self.preset!r}; choose one of {sorted(PRESETS)} "
                             "or null (argmax draft)")
        for key in self.decode:
            if key not in DRAFT_DECODE_KEYS:
                where = "set lev_draft." + key if key in ("tau_delete", "tau_insert", "max_lev_edits") else \
                    "it does not change one greedy block step"
                raise ValueError(f"lev_draft.decode.{key}: not allowed ({where}); allowed keys: "
                                 f"{list(DRAFT_DECODE_KEYS)}")
        fields = dict(tau_delete=self.tau_delete, tau_insert=self.tau_insert, max_lev_edits=self.max_lev_edits,
                      **self.decode)
        for key, value in fields.items():  # DecodeConfig's message names its own field; name the recipe's key
            try:
                DecodeConfig.preset(self.preset, **{key: value})
            except (ValueError, TypeError) as e:
                name = f"lev_draft.decode.{key}" if key in self.decode else f"lev_draft.{key}"
                raise ValueError(f"{name}: {e}") from None
        return DecodeConfig.preset(self.preset, **fields)

    def validate(self):
        self.decode_config()


@dataclass
class SFTTrainerConfig:
    steps: int = doc("optimizer steps", 1000)
    batch_size: int = doc("examples per micro-batch", 64)
    seed: int = doc("seed of data order, noise and initialisation", 0)
    backend: Literal["torch", "deepspeed"] = doc("plain torch, or DeepSpeed ZeRO (gloo on CPU)", "torch")
    zero_stage: int = doc("DeepSpeed ZeRO stage (0-3)", 2)
    dtype: Literal["float32", "bfloat16"] = doc("training dtype of the weights", "float32")
    gradient_checkpointing: bool = doc("recompute layer activations in the backward", False)
    num_threads: int = doc("torch CPU threads (0 = torch default)", 0)
    log_every: int = doc("log training metrics every k steps", 10)
    save_every: int = doc("checkpoint every k steps (0 = only at the end)", 0)
    keep_last: int = doc("checkpoints kept", 2)
    run_dir: Optional[str] = doc("run directory (default runs/<name>-<timestamp>)", None)
    resume: Optional[str] = doc("continue the run in this directory from its latest checkpoint", None)
    resume_changes: list[str] = doc("on resume, keys (or sections, e.g. reward) whose change from the recorded "
                                    "configuration is accepted although it alters what the run learns; other such "
                                    "changes are refused (accepted ones go to config_changes.yaml)",
                                    default_factory=list)
    stop_after: Optional[int] = doc("stop (after checkpointing) at this step; the schedule still spans `steps`", None)
    export_dir: Optional[str] = doc("also save the final model + tokenizer here (save_pretrained)", None)
    export_dtype: Literal["float32", "bfloat16"] = doc("dtype of the exported weights", "float32")
    tracking: Literal["wandb", "none"] = doc("W&B tracking (offline without an API key); JSONL always", "wandb")
    wandb_project: str = doc("W&B project", "ebpo")
    progress: bool = doc("show a progress bar", True)
    plots: bool = doc("write PNG plots of the metrics at the end", True)

    def validate(self):
        for name in ("steps", "batch_size", "log_every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name}: must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"trainer.zero_stage: {self.zero_stage} is not one of 0, 1, 2, 3")


@dataclass
class SFTConfig:
    kind: Literal["sft", "cpt"] = doc("sft: prompt/response rows (prompt never noised); cpt: packed documents", "sft")
    name: str = doc("run name (run directory prefix, W&B name)", "sft")
    model: str = doc("initial weights: a folder, tiny-sft, or preset:NAME[@seed] (random init)", "preset:tiny@0")
    block_size: int = doc("training block size (0 = the model config's block_size)", 0)
    edit_tokens: bool = doc("name the character tokenizer's <|delete|> / <|insert|> ids (105, 106: unused before) "
                            "in a model trained without them (delete_token_id / insert_token_id), for Levenshtein "
                            "SFT (objective.lev_weight); weights and other ids unchanged", False)
    data: SFTDataConfig = doc("datasets", default_factory=SFTDataConfig)
    objective: ObjectiveConfig = doc("M2T + T2T mixture, MTF, normalisation", default_factory=ObjectiveConfig)
    optim: OptimConfig = doc("optimizer and schedule", default_factory=OptimConfig)
    lora: LoraSection = doc("optional PEFT LoRA", default_factory=LoraSection)
    eval: EvalSection = doc("periodic held-out evaluation", default_factory=EvalSection)
    lev_draft: LevDraftSection = doc("decoder thresholds of the Levenshtein rounds' next drafts",
                                     default_factory=LevDraftSection)
    trainer: SFTTrainerConfig = doc("loop, checkpoints, tracking", default_factory=SFTTrainerConfig)
