"""`DecodeConfig`: every knob of draft-and-edit decoding, with named presets and validation.

The presets are the operating points of docs/background.md section 3:

    quality  tau_mask 0.7,  tau_edit 0.5,  max_post_steps 16   (LLaDA2.1 Q Mode)
    speed    tau_mask 0.5,  tau_edit 0.0,  max_post_steps 16   (LLaDA2.1 S Mode: edit whenever the model disagrees)
    m2t      tau_mask 0.95, no editing                          (the LLaDA2.0 baseline)

All three are greedy (temperature 0) with the prefix KV cache on; every field can be overridden:
`DecodeConfig.preset("speed", temperature=0.8, max_new_tokens=64)`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class DecodeConfig:
    """Draft-and-edit decoding settings (see docs/decoding.md for the algorithm).

    block_size: tokens per block K; None = the model's `config.block_size`.
    max_new_tokens: generated positions after the prompt; the canvas is padded up to whole blocks and the
        output is cut to this many tokens (and after the first EOS).
    tau_mask: M2T threshold: a mask is filled when its candidate's probability is > tau_mask (strict).
    tau_edit: T2T threshold: a visible generated token of the active block is replaced when the candidate
        differs and its probability is > tau_edit (strict). None or negative = editing off.
    max_post_steps: iterations allowed after the block has no masks left (each one may edit).
    num_to_transfer: at least this many masks are filled per iteration (the most confident ones).
    temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep only the k most likely tokens before sampling (0 = off).
    top_p: nucleus filtering mass (1.0 = off).
    repetition_penalty: lambda subtracted from the logit, at position i, of the token currently at
        position i-1 (SGLang's anti-repetition penalty, about 3 is typical); 0 = off.
    early_commit: None (off, the default: the reference rule) or a threshold in [0, 1]: the block ends right
        after the iteration that fills its last masks when every token that iteration filled has
        probability > early_commit and it edited nothing, instead of spending a confirming post-step
        forward (with 8-token blocks that forward caps TPF at 4). Eager decoder only.
    mbe_window: Multi-Block Editing: after a block ends, the last W earlier blocks and that block are
        revised together (0 = off).
    mbe_tau: MBE threshold: a token in the window is replaced when the candidate differs with prob > mbe_tau.
    mbe_max_passes: at most this many MBE forwards per finished block (a pass that changes nothing stops early).
    use_cache: prefix KV cache (off = recompute the whole prefix every forward; same tokens, slower).
    stop_at_eos: stop a sequence after the block in which its generated region first holds EOS.
    tau_delete: Levenshtein editing (LLaDA2.2; the model needs `delete_token_id`): a generated position of the
        active block whose probability of DELETE is > tau_delete is removed, the tokens after it shift left and
        the block is padded with [MASK] at the tail. None or negative = off (the default).
    tau_insert: the same for INSERT: x_i becomes ([MASK], x_i), the block is cut at the tail. None = off.
        With either on, a full block takes post-steps even when T2T editing is off (tau_edit None), so that
        DELETE / INSERT can still act on it: a block ends once a post-step changes nothing (docs/decoding.md).
    max_lev_edits: at most this many DELETE / INSERT operations per block and round (the most confident).
    max_batch: most sequences that decode at once (0 = all of a call's prompts). A finished sequence's slot
        takes the next queued prompt at the next forward (continuous batching); tokens never depend on it.
    compiled_step: run each block iteration as one fixed-shape, host-sync-free step compiled with
        `torch.compile(fullgraph=True)` (`rollout.compiled`; same tokens as the eager loop; it keeps its own
        fixed-size cache whatever `use_cache` says). Multi-Block Editing passes still run eagerly beside it, so an
        iteration with both counts two model calls. Off by default: compiling costs tens of seconds on CPU before
        the first step.
    """

    block_size: int | None = None
    max_new_tokens: int = 256
    tau_mask: float = 0.7
    tau_edit: float | None = 0.5
    max_post_steps: int = 16
    num_to_transfer: int = 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 0.0
    early_commit: float | None = None
    mbe_window: int = 0
    mbe_tau: float = 0.9
    mbe_max_passes: int = 2
    use_cache: bool = True
    stop_at_eos: bool = True
    compiled_step: bool = False
    max_batch: int = 0
    tau_delete: float | None = None
    tau_insert: float | None = None
    max_lev_edits: int = 2

    def __post_init__(self):
        self.validate()

    @property
    def editing(self) -> bool:
        """True when T2T editing is on (tau_edit is a number >= 0)."""
        return self.tau_edit is not None and self.tau_edit >= 0

    @property
    def levenshtein(self) -> bool:
        """True when DELETE or INSERT is on (a threshold that is a number >= 0)."""
        return any(t is not None and t >= 0 for t in (self.tau_delete, self.tau_insert))

    @classmethod
    def preset(cls, name: str, **overrides) -> "DecodeConfig":
        """The named preset (`quality`, `speed`, `m2t`) with `overrides` applied (field names checked)."""
        if name not in PRESETS:
            raise ValueError(f"DecodeConfig.preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        _check_names(overrides)
        return cls(**{**PRESETS[name], **overrides})

    def replace(self, **overrides) -> "DecodeConfig":
        """A copy with `overrides` applied (field names checked, result validated)."""
        _check_names(overrides)
        return dataclasses.replace(self, **overrides)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and what it accepts."""
        def bad(name, allowed):
            raise ValueError(f"DecodeConfig.{name}: got {getattr(self, name)!r}; allowed: {allowed}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if self.block_size is not None and not (is_int(self.block_size) and self.block_size >= 1):
            bad("block_size", "None or an integer >= 1")
        if not (is_int(self.max_new_tokens) and self.max_new_tokens >= 1):
            bad("max_new_tokens", "an integer >= 1")
        if not (is_num(self.tau_mask) and 0.0 <= self.tau_mask <= 1.0):
            bad("tau_mask", "a number in [0, 1]")
        if self.tau_edit is not None and not (is_num(self.tau_edit) and self.tau_edit <= 1.0):
            bad("tau_edit", "None (off), a negative number (off) or a number in [0, 1]")
        if not (is_int(self.max_post_steps) and self.max_post_steps >= 0):
            bad("max_post_steps", "an integer >= 0")
        if not (is_int(self.num_to_transfer) and self.num_to_transfer >= 1):
            bad("num_to_transfer", "an integer >= 1")
        if not (is_num(self.temperature) and self.temperature >= 0):
            bad("temperature", "a number >= 0 (0 = greedy)")
        if not (is_int(self.top_k) and self.top_k >= 0):
            bad("top_k", "an integer >= 0 (0 = off)")
        if not (is_num(self.top_p) and 0.0 < self.top_p <= 1.0):
            bad("top_p", "a number in (0, 1] (1 = off)")
        if not (is_num(self.repetition_penalty) and self.repetition_penalty >= 0):
            bad("repetition_penalty", "a number >= 0 (0 = off)")
        if self.early_commit is not None and not (is_num(self.early_commit) and 0.0 <= self.early_commit <= 1.0):
            bad("early_commit", "None (off) or a number in [0, 1]")
        if not (is_int(self.mbe_window) and self.mbe_window >= 0):
            bad("mbe_window", "an integer >= 0 (0 = off)")
        if not (is_num(self.mbe_tau) and 0.0 <= self.mbe_tau <= 1.0):
            bad("mbe_tau", "a number in [0, 1]")
        if not (is_int(self.mbe_max_passes) and self.mbe_max_passes >= 1):
            bad("mbe_max_passes", "an integer >= 1")
        for name in ("tau_delete", "tau_insert"):
            if getattr(self, name) is not None and not (is_num(getattr(self, name)) and getattr(self, name) <= 1.0):
                bad(name, "None (off), a negative number (off) or a number in [0, 1]")
        if not (is_int(self.max_batch) and self.max_batch >= 0):
            bad("max_batch", "an integer >= 0 (0 = every prompt of a call at once)")
        if not (is_int(self.max_lev_edits) and self.max_lev_edits >= 1):
            bad("max_lev_edits", "an integer >= 1")
        for name in ("use_cache", "stop_at_eos", "compiled_step"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false")

    def to_dict(self) -> dict:
        """Plain dict of all fields (JSON-ready)."""
        return dataclasses.asdict(self)


PRESETS: dict[str, dict] = {
    "quality": dict(tau_mask=0.7, tau_edit=0.5, max_post_steps=16),
    "speed": dict(tau_mask=0.5, tau_edit=0.0, max_post_steps=16),
    "m2t": dict(tau_mask=0.95, tau_edit=None, max_post_steps=16),
}

FIELD_NAMES = tuple(f.name for f in fields(DecodeConfig))


def _check_names(overrides: dict) -> None:
    unknown = sorted(set(overrides) - set(FIELD_NAMES))
    if unknown:
        raise ValueError(f"DecodeConfig: unknown field(s) {unknown}; fields are {list(FIELD_NAMES)}")


def parse_override(item: str) -> tuple[str, object]:
    """`key=value` (as typed on a command line) -> (field, typed value); `none`/`null` give None.

    The type follows the field: ints, floats, booleans (true/false/1/0/yes/no), optional numbers.
    """
    key, sep, raw = item.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ValueError(f"override {item!r}: expected key=value")
    _check_names({key: None})
    default = {f.name: f for f in fields(DecodeConfig)}[key].default
    if raw.lower() in {"none", "null"}:
        return key, None
    if isinstance(default, bool):
        low = raw.lower()
        if low not in {"true", "false", "1", "0", "yes", "no"}:
            raise ValueError(f"override {key}: expected true/false, got {raw!r}")
        return key, low in {"true", "1", "yes"}
    try:
        if key in {"block_size", "max_new_tokens", "max_post_steps", "num_to_transfer", "top_k", "mbe_window",
                   "mbe_max_passes", "max_lev_edits", "max_batch"}:
            return key, int(raw)
        return key, float(raw)
    except ValueError:
        raise ValueError(f"override {key}: {raw!r} is not a number") from None


__all__ = ["DecodeConfig", "PRESETS", "FIELD_NAMES", "parse_override"]
