"""The learner's configuration (`LearnerConfig`, the recipe's `learner` section) and its LR schedule.

Kept apart from `ebpo.rl.learner` so that reading the options does not mean reading the update loop;
`ebpo.rl.learner` re-exports both names.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Optional


from ebpo.core.algos import KL_ESTIMATORS
from ebpo.core.editing import T2T_SOURCES
from ebpo.core.schedule import lr_schedule
from ebpo.infra.config import doc
from ebpo.infra.lora import LORA_TARGETS, LoraSection  # noqa: F401 (re-exported)



@dataclass
class LearnerLora(LoraSection):
    """The learner's LoRA section: the CPT/SFT `lora` section with the RL defaults (r 8, alpha 16)."""
    r: int = doc("LoRA rank", 8)
    alpha: float = doc("LoRA alpha (the adapter's output is scaled by alpha / r)", 16.0)

    @staticmethod
    def upgrade_spelling(value, key: str):
        """ebpo 0.1 spelled `learner.lora` as a mapping without `enabled` (LoRA on) or null (off); both
        still work for one release, the mapping with a warning naming the new key."""
        if value is None:
            return {}
        if isinstance(value, dict) and "enabled" not in value:
            warnings.warn(f"{key}: a LoRA mapping without `enabled` is deprecated and will be refused in the next "
                          f"release; write {key}.enabled: true (the spelling of a CPT/SFT recipe's lora section)",
                          DeprecationWarning, stacklevel=2)
            return {**value, "enabled": True}
        return value


@dataclass
class LearnerConfig:
    lr: float = doc("peak learning rate (0 = a frozen policy, e.g. to check that off-policy ratios are 1)", 1e-6)
    weight_decay: float = doc("AdamW weight decay", 0.0)
    beta1: float = doc("AdamW beta1 (the key CPT/SFT recipes spell optim.beta1)", 0.9)
    beta2: float = doc("AdamW beta2 (the key CPT/SFT recipes spell optim.beta2)", 0.999)
    betas: Optional[list[float]] = doc("deprecated: [beta1, beta2]; write learner.beta1 and learner.beta2", None)
    warmup_steps: int = doc("linear warm-up length, in updates (RL steps; fractional within an update)", 0)
    total_steps: Optional[int] = doc("schedule length in updates (RL steps); needed by the cosine schedule; null "
                                     "= trainer.steps in an RL recipe (0 for a learner built on its own)", None)
    schedule: Literal["constant", "cosine"] = doc("LR schedule after warm-up (cosine decays to 0 at total_steps)",
                                                  "constant")
    grad_clip: float = doc("max global grad norm per optimizer step; 0 = no clipping", 1.0)
    mu: int = doc("epochs over each rollout batch", 1)
    minibatch_size: int = doc("sequences per optimizer step (0 = whole batch)", 0)
    n_draws: int = doc("Monte Carlo noise draws N per sequence (stratified noise levels)", 8)
    t_min: float = doc("smallest noise level (mask probability), > 0 because of the 1/t weight (noise: bernoulli)",
                       0.1)
    t_max: float = doc("largest noise level, <= 1 (noise: bernoulli)", 1.0)
    noise: Literal["bernoulli", "exact_elbo"] = doc(
        "noise draws of the block ELBO: bernoulli (each response token masked with prob. t, t stratified on "
        "[t_min, t_max], weight 1/t, one mask forced per block) or exact_elbo (exactly k ~ U{1..m} of a "
        "block's m response tokens masked, weight m/k: LLaDA's ELBO, t_min/t_max unused; the default: lower "
        "log-ratio variance, docs/ebpo.md)", "exact_elbo")
    t2t_weight: float = doc("editing-aware composite (docs/ebpo.md): weight lambda of the T2T terms (a substituted "
                            "token scores log p(clean) x lambda / t2t_rate); 0 = mask-only, bit for bit", 0.0)
    t2t_rate: float = doc("fraction of the visible response tokens of each draw substituted (t2t_weight > 0)", 0.15)
    t2t_source: Literal["uniform", "draft", "mixed"] = doc("substitutes: uniform random tokens (SFT T2T stream), "
                                                           "the policy's sampled drafts (MTF) or half each", "uniform")
    levenshtein: bool = doc("L-EBPO (ebpo/core/lev_likelihood.py): score DELETE / INSERT too, edit labels recovered "
                            "per draw by aligning the noised pre-edit draft with the output; false = EBPO", False)
    levenshtein_weight: float = doc("L-EBPO: weight lambda of the visible positions with an edit label", 1.0)
    eps_low: float = doc("clip: ratio floor 1 - eps_low for negative advantages", 0.2)
    eps_high: float = doc("clip: ratio ceiling 1 + eps_high for positive advantages", 0.28)
    dual_clip: Optional[float] = doc("dual clip c > 1: for negative advantages the objective is at least c * A, so "
                                     "a sequence whose likelihood rose a lot cannot blow the loss up (null = off)", 3.0)
    length_normalize: bool = doc("divide each sequence's log-ratio (and KL) by its response length", False)
    kl_beta: float = doc("weight of the KL penalty against the frozen reference (0 = off)", 0.0)
    kl_estimator: Literal["k1", "k2", "k3"] = doc("KL estimator of the penalty/metric", "k3")
    packed: bool = doc("N noisy copies share one clean copy in a forward ((N+1)L instead of 2NL tokens)", True)
    grad_replay: bool = doc("compute composites without grad, then replay draws with grad (memory flat in N)", True)
    nograd_chunk: int = doc("draws per no-grad forward (old/ref/current values); 0 = all N", 0)
    replay_chunk: int = doc("draws per replayed forward with grad (activations alive at once)", 1)
    nograd_cached: bool = doc("no-grad passes run the clean copy once into a KV cache and the noisy copies "
                              "against it (fewer attention scores than packed; same values)", True)
    backend: Literal["torch", "deepspeed"] = doc("optimizer engine: torch (AdamW; with several ranks the gradients "
                                                 "are summed by all-reduce, as DDP does) or deepspeed (ZeRO)", "torch")
    zero_stage: int = doc("DeepSpeed ZeRO stage (0-3)", 2)
    offload_optimizer: bool = doc("DeepSpeed: keep optimizer states (and fp32 master weights) in CPU memory", False)
    offload_param: bool = doc("DeepSpeed ZeRO-3: keep partitioned parameters in CPU memory", False)
    num_workers: int = doc("learner ranks W: Ray actors forming one torch.distributed group (gloo on CPU, NCCL on "
                           "GPU); each minibatch is split over them by tokens and the update equals one rank's "
                           "on the whole minibatch", 1)
    dtype: Literal["fp32", "bf16"] = doc("compute dtype of the policy forward: bf16 autocast (torch) or bf16 "
                                         "weights with fp32 master copies (deepspeed); the LM head, log-softmax "
                                         "and every composite sum stay in fp32", "fp32")
    gradient_checkpointing: bool = doc("recompute each layer's activations in the backward (memory per token "
                                       "falls from all layers' activations to one layer's plus the layer "
                                       "inputs; about one extra forward of compute)", False)
    max_tokens_per_microbatch: int = doc("token budget of one forward/backward on a rank: rows x their longest "
                                         "length (rounded up to whole blocks), rows sorted by length so padding "
                                         "stays small; 0 = a rank's whole share of a minibatch at once", 0)
    lora: "LearnerLora" = doc("PEFT LoRA, spelled as a CPT/SFT recipe's `lora` section (enabled, r, alpha, dropout, "
                              "target_modules); enabled false = full fine-tuning", default_factory=lambda: LearnerLora())
    max_staleness: int = doc("asynchronous RL: versions a sample's weights may lag the learner's; > 0 keeps that "
                             "many weight snapshots for the decoupled loss. In an RL recipe set trainer.max_staleness "
                             "(its one owner, copied here); this key is a deprecated alias of it", 0)
    is_cap: float = doc("asynchronous RL: cap of the truncated behaviour->proximal importance weight", 2.0)
    seed: Optional[int] = doc("seed of the learner's noise-draw generator (and minibatch shuffling); null = "
                              "trainer.seed in an RL recipe (0 for a learner built on its own)", None)
    block_size: Optional[int] = doc("block size K of the likelihood; null = the model's", None)
    device: str = doc("auto (cuda if available), cpu or cuda[:i]; DeepSpeed places the model itself", "auto")

    def validate(self):
        if self.betas is not None and len(self.betas) == 2:  # the old spelling, kept for one release
            warnings.warn("learner.betas is deprecated and will be removed in the next release; write learner.beta1 "
                          "and learner.beta2 (as CPT/SFT recipes write optim.beta1 and optim.beta2)",
                          DeprecationWarning, stacklevel=2)
            self.beta1, self.beta2 = (float(b) for b in self.betas)
            self.betas = None
        checks = [
            ("lr", self.lr >= 0, "must be >= 0 (0 = frozen policy)"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("betas", self.betas is None or (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)),
             "must be two numbers in [0, 1)"),
            ("beta1", 0 <= self.beta1 < 1, "must lie in [0, 1)"),
            ("beta2", 0 <= self.beta2 < 1, "must lie in [0, 1)"),
            ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            ("total_steps", self.total_steps is None or self.total_steps >= 0, "must be >= 0"),
            # unset (None) is filled in from trainer.steps by RLConfig, which validates again
            ("total_steps", self.schedule != "cosine" or self.total_steps is None or self.total_steps > self.warmup_steps,
             "the cosine schedule needs total_steps > warmup_steps"),
            ("schedule", self.schedule in ("constant", "cosine"), "choose constant or cosine"),
            ("grad_clip", self.grad_clip >= 0, "must be >= 0 (0 = off)"),
            ("mu", self.mu >= 1, "must be >= 1"),
            ("minibatch_size", self.minibatch_size >= 0, "must be >= 0 (0 = whole batch)"),
            ("n_draws", self.n_draws >= 1, "must be >= 1"),
            ("t_min", 0 < self.t_min <= self.t_max, "need 0 < t_min <= t_max"),
            ("t_max", self.t_max <= 1, "must be <= 1"),
            ("noise", self.noise in ("bernoulli", "exact_elbo"), "choose bernoulli or exact_elbo"),
            ("t2t_weight", self.t2t_weight >= 0, "must be >= 0 (0 = mask-only composite)"),
            ("t2t_rate", 0 < self.t2t_rate < 1, "must lie in (0, 1)"),
            ("t2t_source", self.t2t_source in T2T_SOURCES, f"choose one of {list(T2T_SOURCES)}"),
            ("levenshtein", not (self.levenshtein and self.t2t_weight > 0), "needs t2t_weight = 0 (mask-only draws)"),
            ("levenshtein_weight", self.levenshtein_weight >= 0, "must be >= 0"),
            ("eps_low", 0 <= self.eps_low < 1, "must be in [0, 1)"),
            ("eps_high", self.eps_high >= 0, "must be >= 0"),
            ("dual_clip", self.dual_clip is None or self.dual_clip > 1, "must be > 1 or null"),
            ("kl_beta", self.kl_beta >= 0, "must be >= 0"),
            ("kl_estimator", self.kl_estimator in KL_ESTIMATORS, f"choose one of {list(KL_ESTIMATORS)}"),
            ("nograd_chunk", self.nograd_chunk >= 0, "must be >= 0 (0 = all draws)"),
            ("replay_chunk", self.replay_chunk >= 1, "must be >= 1"),
            ("backend", self.backend in ("torch", "deepspeed"), "choose torch or deepspeed"),
            ("zero_stage", self.zero_stage in (0, 1, 2, 3), "choose 0, 1, 2 or 3"),
            ("block_size", self.block_size is None or self.block_size >= 1, "must be >= 1 or null"),
            ("num_workers", self.num_workers >= 1, "must be >= 1"),
            ("max_staleness", isinstance(self.max_staleness, int) and self.max_staleness >= 0, "must be an int >= 0"),
            ("max_staleness", self.max_staleness == 0 or self.backend == "torch", "> 0 needs learner.backend=torch"),
            ("is_cap", self.is_cap >= 1, "must be >= 1"),
            ("dtype", self.dtype in ("fp32", "bf16"), "choose fp32 or bf16"),
            ("max_tokens_per_microbatch", self.max_tokens_per_microbatch >= 0, "must be >= 0 (0 = off)"),
            ("offload_param", not self.offload_param or (self.backend == "deepspeed" and self.zero_stage == 3),
             "needs backend=deepspeed and zero_stage=3"),
            ("offload_optimizer", not self.offload_optimizer or (self.backend == "deepspeed" and self.zero_stage >= 1),
             "needs backend=deepspeed and zero_stage >= 1"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"learner.{name}: {why} (got {getattr(self, name)!r})")
        try:
            self.lora.validate()
        except ValueError as err:
            raise ValueError(f"learner.lora.{err}") from None


def lr_factor(progress: float, cfg: LearnerConfig, step_frac: float = 0.0) -> float:
    """LR multiplier of the optimizer step starting at `progress` updates (float) and lasting `step_frac`:
    the shared schedule (`ebpo.core.schedule.lr_schedule`) with the learner's warm-up, length and shape."""
    return lr_schedule(progress, step_frac, cfg.warmup_steps, cfg.total_steps or 0, cfg.schedule)
