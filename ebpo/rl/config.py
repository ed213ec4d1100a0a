"""Typed configuration of an RL (EBPO) recipe: `ebpo train recipes/rl_*.yaml key=value ...`.

Sections: `model`, `data`, `rollout`, `reward`, `learner` (`ebpo.rl.learner_config.LearnerConfig`),
`trainer`, `ray`. `ebpo train RECIPE.yaml --help` lists every key with its documentation. The whole
configuration, the learner section included, is built and validated once, by `load_config`, and the
learner ranks receive that `LearnerConfig` object as it is.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Literal, Optional, Union

from rewards import check_timeout_budget
from rollout.config import DecodeConfig
from rollout.multiturn import MultiTurnConfig

from ebpo.infra.config import ConfigError, doc
from ebpo.model.configuration_llada2_moe import LLaDA2MoeConfig
from ebpo.model.loading import resolve_model_path
from ebpo.model.presets import load_preset
from ebpo.rl.learner_config import LearnerConfig


@dataclass
class DataConfig:
    train: Union[str, list[str]] = doc("training prompts: .jsonl, .parquet, hf:NAME[:split] (local datasets "
                                       "only), rg:NAME?size=N&seed=S[&key=value] (a reasoning-gym dataset) or "
                                       "vf:REF[?split=eval] (a verifiers environment's; both the envs extra), or a "
                                       "list of them",
                     "examples/data/math_train.jsonl")
    eval: Union[str, list[str], None] = doc("held-out prompts (or a list of sources) for greedy Quality Mode "
                                            "evaluation; null = no eval", None)
    prompt_field: str = doc("row field holding the user prompt", "prompt")
    chat_template: bool = doc("wrap prompts in the tokenizer's chat template", True)
    max_prompt_tokens: int = doc("longest prompt (after the chat template) in tokens; longer prompts are "
                                 "handled as data.overlong_prompts says, never cut", 256)
    overlong_prompts: Literal["filter", "error"] = doc(
        "prompts longer than data.max_prompt_tokens: filter (dropped at load time; the count is logged and "
        "recorded as data/overlong_train_prompts and data/overlong_eval_prompts) or error (stop at start-up "
        "naming the first such row)", "filter")
    shuffle: bool = doc("reshuffle the training rows every epoch (seeded by trainer.seed)", True)

    def validate(self):
        if self.max_prompt_tokens <= 0:
            raise ValueError("data.max_prompt_tokens: must be positive")
        if self.overlong_prompts not in ("filter", "error"):
            raise ValueError(f"data.overlong_prompts: choose filter or error, got {self.overlong_prompts!r}")


@dataclass
class RolloutConfig:
    num_workers: int = doc("rollout actors; each holds a policy copy", 1)
    prompts_per_step: int = doc("prompts per RL step", 16)
    group_size: int = doc("samples per prompt (G); advantages are normalised inside each group", 8)
    preset: Literal["quality", "speed", "m2t"] = doc("decode preset for rollouts", "speed")
    decode: dict = doc("DecodeConfig overrides for rollouts, e.g. {temperature: 0.8, max_new_tokens: 32}",
                       default_factory=dict)
    eval_preset: Literal["quality", "speed", "m2t"] = doc("decode preset for evaluation (greedy)", "quality")
    eval_decode: dict = doc("DecodeConfig overrides for evaluation", default_factory=dict)
    fp8: bool = doc("run rollouts with per-block FP8 linear layers (kernels.fp8)", False)
    num_threads: int = doc("torch threads per rollout actor (0 = torch default)", 0)
    tensor_parallel: int = doc("ranks that split a rollout worker's attention heads, dense MLP, shared expert and LM "
                               "head (1 = off). The model's attention heads must be divisible by it, and its KV heads "
                               "divisible by it or dividing it (then each rank keeps the one KV head its query heads "
                               "read). A worker spans max(tensor_parallel, expert_parallel) ranks; `ebpo plan` gives "
                               "the memory per rank (docs/decoding.md, Parallel rollout workers). Planned and checked "
                               "only, for now: the rollout worker does not read it yet", 1)
    expert_parallel: int = doc("ranks that split a rollout worker's routed experts, tokens dispatched to and combined "
                               "from them by all-to-all (1 = off). The model's num_experts must be divisible by it, "
                               "and it must divide tensor_parallel or be a multiple of it", 1)

    def validate(self):
        for name in ("num_workers", "prompts_per_step", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}: must be >= 1")
        for name in ("tensor_parallel", "expert_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rollout.{name}: must be an integer >= 1 (1 = off), got {value!r}")
        tp, ep = self.tensor_parallel, self.expert_parallel
        if max(tp, ep) % min(tp, ep):
            raise ValueError(f"rollout.expert_parallel = {ep} and rollout.tensor_parallel = {tp}: one must divide "
                             f"the other (a worker spans max of the two = {max(tp, ep)} ranks); allowed "
                             f"rollout.expert_parallel with tensor_parallel {tp}: a divisor or multiple of {tp}")

    def check_parallel(self, num_heads: int, num_kv_heads: int, num_experts: int) -> None:
        """Start-up check of `tensor_parallel` / `expert_parallel` against the model's attention heads, KV heads
        and routed experts; ConfigError naming the key and its allowed values."""
        tp, ep = self.tensor_parallel, self.expert_parallel
        allowed_tp = [d for d in range(1, num_heads + 1)
                      if num_heads % d == 0 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)]
        if tp not in allowed_tp:
            raise ConfigError(f"rollout.tensor_parallel = {tp}: the model's {num_heads} attention heads must be "
                              f"divisible by it and its {num_kv_heads} KV heads divisible by it or dividing it; "
                              f"allowed: {allowed_tp}")
        allowed_ep = [d for d in range(1, max(num_experts, 1) + 1) if max(num_experts, 1) % d == 0]
        if ep not in allowed_ep:
            raise ConfigError(f"rollout.expert_parallel = {ep}: the model's {num_experts} routed experts must be "
                              f"divisible by it; allowed: {allowed_ep}")


@dataclass
class RewardFnConfig:
    fn: str = doc("built-in reward name (math, code, format_boxed, ...) or module:function / path.py:function")
    weight: float = doc("weight in the combined score", 1.0)
    kwargs: dict = doc("extra keyword arguments passed to the reward", default_factory=dict)
    judge: bool = doc("this reward decides whether a held-out row is solved (false for shaping rewards such as "
                      "partial credit: they shape training but do not define correctness)", True)


@dataclass
class RewardConfig:
    fns: list[RewardFnConfig] = doc("rewards combined with weights",
                                    default_factory=lambda: [RewardFnConfig(fn="math")])
    num_actors: int = doc("reward actors (CPU only)", 1)
    num_workers: int = doc("worker processes per reward actor", 2)
    timeout_s: float = doc("hard wall-clock limit per reward call, enforced from outside the call", 10.0)
    default_score: float = doc("score of a sample whose reward timed out or raised", 0.0)

    def validate(self):
        if not self.fns:
            raise ValueError("reward.fns: at least one reward is required")
        if not any(f.judge for f in self.fns):
            raise ValueError("reward.fns: at least one reward needs judge: true (it decides held-out accuracy)")
        if self.timeout_s <= 0:
            raise ValueError("reward.timeout_s: must be positive")

        # the hard per-call kill must outlast a code reward's own deadlines, or honest slow programs die
        check_timeout_budget([(f.fn, f.weight, f.kwargs) for f in self.fns], self.timeout_s)


@dataclass
class TrainerConfig:
    steps: int = doc("RL steps (one rollout batch and one learner update each)", 20)
    seed: int = doc("base seed: data order, rollout seeds and learner noise draws derive from it", 0)
    eval_every: int = doc("evaluate every k steps (and at start and end); 0 = only start and end", 0)
    eval_size: int = doc("held-out rows used for evaluation (0 = all)", 0)
    save_every: int = doc("checkpoint every k steps (0 = only at the end)", 0)
    keep_last: int = doc("checkpoints kept", 2)
    filter_zero_std: bool = doc("drop groups whose rewards are all equal (no learning signal)", False)
    dynamic_sampling: int = doc("extra rounds of `rollout.prompts_per_step` prompts a step may draw until that many "
                                "groups have unequal rewards (DAPO dynamic sampling; the learner takes the first "
                                "`prompts_per_step` of them); 0 = off; needs filter_zero_std", 0)
    advantage: Literal["grpo", "rloo"] = doc("advantage estimator, computed per prompt group", "grpo")
    advantage_std: bool = doc("GRPO: divide by the group's reward std (Dr. GRPO style when false)", True)
    stop_after: Optional[int] = doc("stop after this step although `steps` is larger (staged runs; the LR "
                                    "schedule still spans `steps`)", None)
    run_dir: Optional[str] = doc("run directory; default runs/<name>-<timestamp>", None)
    resume: Optional[str] = doc("continue the run in this directory from its latest checkpoint", None)
    resume_changes: list[str] = doc("on resume, keys (or sections, e.g. reward) whose change from the recorded "
                                    "configuration is accepted although it alters what the run learns; other such "
                                    "changes are refused (accepted ones go to config_changes.yaml)",
                                    default_factory=list)
    tracking: Literal["wandb", "none"] = doc("W&B tracking (offline without an API key); JSONL always", "wandb")
    wandb_project: str = doc("W&B project", "ebpo")
    samples_per_step: int = doc("rows of the per-step W&B sample table", 4)
    max_retries: int = doc("retries of a rollout/reward call whose actor died (actor restarted each time)", 3)
    max_staleness: int = doc("asynchronous RL: 0 = synchronous (rollout, reward, update, sync in turn); s > 0 = the "
                             "rollouts and rewards of step k are made with the weights after step k - 1 - s while "
                             "the learner trains, so a sample lags the learner by at most s weight versions and "
                             "is trained with the decoupled off-policy loss (docs/rl.md, Asynchronous RL)", 0)
    partial_rollouts: bool = doc("partial rollouts: a step trains on the prompt groups that finished; unfinished "
                                 "sequences stop at a block boundary and carry over to the next step under the "
                                 "newer weights, every block recording the version that decoded it, and the learner "
                                 "takes each block's behaviour term from that version (docs/rl.md, Partial "
                                 "rollouts). Works with max_staleness 0 and > 0, single- and multi-turn", False)
    partial_max_lag: Optional[int] = doc("partial rollouts: no trained block is more than this many versions behind "
                                         "the learner that trains it (a group about to pass it is waited for or "
                                         "dropped, trainer.partial_overdue); the learner keeps this many weight "
                                         "versions. null = max_staleness + 1", None)
    partial_overdue: str = doc("partial rollouts: what becomes of a group that would pass partial_max_lag at the "
                               "next step: wait (this step also waits for it to finish and trains it, beyond "
                               "prompts_per_step: nothing is thrown away) or drop (it carries over and the next step "
                               "drops and counts it, partial/dropped)", "wait")
    partial_extra_groups: Optional[int] = doc("partial rollouts: prompt groups kept in flight beyond the "
                                              "prompts_per_step a step trains on, so that a step takes the first "
                                              "groups to finish while stragglers run on (the first step draws "
                                              "them; later steps draw as many as finished). null = "
                                              "rollout.prompts_per_step", None)
    progress: bool = doc("rich progress display", True)
    plots: bool = doc("write PNG plots into the run directory at the end", True)

    def validate(self):
        if self.partial_max_lag is not None and (isinstance(self.partial_max_lag, bool)
                                                 or not isinstance(self.partial_max_lag, int)
                                                 or self.partial_max_lag < max(1, self.max_staleness)):
            raise ValueError(f"trainer.partial_max_lag: must be an integer >= max(1, trainer.max_staleness) = "
                             f"{max(1, self.max_staleness)} or null, got {self.partial_max_lag!r}")
        if self.partial_extra_groups is not None and (isinstance(self.partial_extra_groups, bool)
                                                      or not isinstance(self.partial_extra_groups, int)
                                                      or self.partial_extra_groups < 0):
            raise ValueError(f"trainer.partial_extra_groups: must be an integer >= 0 or null, got "
                             f"{self.partial_extra_groups!r}")
        if self.partial_overdue not in ("wait", "drop"):
            raise ValueError(f"trainer.partial_overdue: got {self.partial_overdue!r}; allowed: ['wait', 'drop']")
        if self.partial_rollouts and self.dynamic_sampling:
            raise ValueError("trainer.partial_rollouts: cannot be combined with trainer.dynamic_sampling (a partial "
                             "step trains on the groups that finished; set trainer.dynamic_sampling=0)")
        if self.steps < 0:
            raise ValueError("trainer.steps: must be >= 0")
        if self.dynamic_sampling < 0:
            raise ValueError(f"trainer.dynamic_sampling: must be >= 0 (extra rounds; 0 = off), got {self.dynamic_sampling}")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"trainer.max_staleness: must be an integer >= 0 (0 = synchronous), got "
                             f"{self.max_staleness!r}")
        if self.dynamic_sampling > 0 and not self.filter_zero_std:
            raise ValueError("trainer.dynamic_sampling: needs trainer.filter_zero_std=true (it collects groups "
                             "with unequal rewards, which only matters when the others are dropped)")


@dataclass
class EnvConfig:
    name: Optional[str] = doc("multi-turn (agentic) rollouts against this environment: a built-in (calculator), "
                              "package.module:name or path/to/file.py:name, called with env.kwargs to build one "
                              "environment per trajectory (docs/rl.md, Agentic RL); null = single-turn rollouts", None)
    kwargs: dict = doc("keyword arguments of the environment factory, e.g. {max_turns: 3, latency_s: 0.5}",
                       default_factory=dict)
    turns: MultiTurnConfig = doc("limits of a multi-turn rollout (rollout.multiturn.MultiTurnConfig)",
                                 default_factory=MultiTurnConfig)
    agent: Optional[str] = doc("agent RL instead of an environment: an async function `agent(client, row)`, "
                               "package.module:name or path/to/file.py:name, that gets an OpenAI client pointed at an "
                               "in-process gateway to the rollout worker and returns a reward or a record; env.kwargs "
                               "are its keyword arguments (docs/rl.md, Agent functions); null = env.name decides", None)
    episode_norm: str = doc("agent RL: how much each learner row of an episode weighs: none (the episode's advantage "
                            "on every row), segments (an episode whose history was rewritten trains each of its k "
                            "segments with advantage / k), turns (advantage / the episode's model turns, so long "
                            "episodes do not outweigh short ones) (ebpo/rl/episodes.py)", "none")

    @property
    def multi_turn(self) -> bool:
        return bool(self.name or self.agent)

    def validate(self):
        if self.episode_norm not in ("none", "segments", "turns"):
            raise ValueError(f"env.episode_norm: got {self.episode_norm!r}; allowed: ['none', 'segments', 'turns']")
        if self.name and self.agent:
            raise ValueError(f"env: set env.name (an environment) or env.agent (an agent function), not both; got "
                             f"name={self.name!r}, agent={self.agent!r}")


@dataclass
class RayConfig:
    address: Optional[str] = doc("Ray cluster address; null = start a local instance (embedded default)", None)
    num_cpus: Optional[int] = doc("CPUs of the local instance (null = all)", None)
    rollout_gpus: float = doc("GPUs per rollout actor", 0.0)
    learner_gpus: float = doc("GPUs for the learner actor", 0.0)
    reward_cpus: float = doc("CPUs per reward actor (its worker processes are not counted by Ray)", 0.0)
    colocate: bool = doc("pack rollout and learner actors into one placement group (same node)", False)
    spread_nodes: int = doc("spread the policy actors over this many nodes: one placement-group bundle per node "
                            "(STRICT_SPREAD), rollout worker i and learner rank r on node i mod n and r mod n; "
                            "0 = off (Ray's default scheduler, or ray.colocate)", 0)
    weight_sync: Literal["object_store", "broadcast"] = doc(
        "how weights reach the rollout workers after each update: object_store (the learner puts its "
        "weights into the Ray object store once, one part per bucket) or broadcast (bucketed "
        "torch.distributed broadcast from the learner: NCCL when learner and rollout actors each hold >= 1 "
        "GPU, else gloo over TCP; falls back to the object store for a sync after a rollout worker restart "
        "or a failure)", "object_store")
    bucket_mb: float = doc("weight-sync bucket size in MiB: the learner gathers (ZeRO-3), sends and the "
                           "workers load the weights one bucket at a time; tensors are packed in order into "
                           "buckets of one dtype, a larger tensor gets a bucket of its own", 256.0)
    sync_timeout_s: float = doc("broadcast: seconds allowed for forming the group and for each wait inside a "
                                "sync (the plan, each bucket); past it the sync falls back to the object store",
                                300.0)

    def validate(self):
        if self.spread_nodes < 0:
            raise ValueError(f"ray.spread_nodes: must be >= 0 (0 = off), got {self.spread_nodes}")
        if self.spread_nodes > 0 and self.colocate:
            raise ValueError("ray.spread_nodes: cannot be combined with ray.colocate=true (one node); choose one")
        if not (math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise ValueError(f"ray.bucket_mb: must be a positive number of MiB, got {self.bucket_mb!r}")
        if self.bucket_mb * 2**20 < 1:
            raise ValueError(f"ray.bucket_mb: {self.bucket_mb!r} MiB is less than one byte")
        if not (math.isfinite(self.sync_timeout_s) and self.sync_timeout_s > 0):
            raise ValueError(f"ray.sync_timeout_s: must be a positive number of seconds, got {self.sync_timeout_s!r}")


@dataclass
class RLConfig:
    kind: Literal["rl"] = doc("recipe kind", "rl")
    name: str = doc("run name", "rl")
    model: str = doc("initial policy: folder, tiny-sft (shipped) or preset:NAME[@seed]", "tiny-sft")
    model_overrides: dict = doc(
        "model config fields this run changes, for the learner and the rollout workers alike, e.g. "
        "{delete_token_id: 105, insert_token_id: 106} (name the edit-control tokens of a checkpoint saved without "
        "them: DELETE / INSERT decoding and L-EBPO need them) or {block_routing_capacity: 3} (LLaDA2.2 block "
        "routing); the changed model is written to RUN_DIR/init_model at start-up. Allowed: "
        "delete_token_id, insert_token_id, block_routing_capacity", default_factory=dict)
    data: DataConfig = doc("prompts", default_factory=DataConfig)
    rollout: RolloutConfig = doc("rollout workers and decoding", default_factory=RolloutConfig)
    reward: RewardConfig = doc("reward functions and workers", default_factory=RewardConfig)
    learner: LearnerConfig = doc("the EBPO learner (ebpo.rl.learner_config.LearnerConfig); total_steps and seed "
                                 "default to trainer.steps and trainer.seed", default_factory=LearnerConfig)
    trainer: TrainerConfig = doc("loop, evaluation, checkpoints, tracking", default_factory=TrainerConfig)
    env: EnvConfig = doc("multi-turn environment (agentic RL); env.name null = single-turn", default_factory=EnvConfig)
    ray: RayConfig = doc("cluster and resources", default_factory=RayConfig)

    def validate(self):
        """Cross-section checks, and the learner fields an RL recipe derives from its trainer section:
        `learner.total_steps` (unset = trainer.steps), `learner.seed` (unset = trainer.seed) and
        `learner.max_staleness` (always trainer.max_staleness, its one owner; with partial rollouts the lag
        bound, trainer.partial_max_lag)."""
        lc, tc = self.learner, self.trainer
        # partial rollouts: the learner keeps the versions a carried-over block may come from
        keep = (tc.partial_max_lag if tc.partial_max_lag is not None else tc.max_staleness + 1) \
            if tc.partial_rollouts else tc.max_staleness
        if lc.max_staleness and lc.max_staleness != keep:
            if tc.max_staleness:
                raise ConfigError(f"learner.max_staleness = {lc.max_staleness} conflicts with trainer.max_staleness = "
                                  f"{tc.max_staleness}; set trainer.max_staleness only (it sets the learner's)")
            warnings.warn("learner.max_staleness is deprecated and will be removed in the next release; set "
                          "trainer.max_staleness instead", DeprecationWarning, stacklevel=2)
            tc.max_staleness = lc.max_staleness
            tc.validate()
            keep = tc.max_staleness
        lc.max_staleness = keep
        if lc.total_steps is None:
            lc.total_steps = tc.steps
        if lc.seed is None:
            lc.seed = tc.seed
        try:
            lc.validate()  # again: max_staleness and total_steps were set above
        except ValueError as err:
            raise ConfigError(str(err)) from None
        unknown = sorted(set(self.model_overrides) - set(MODEL_OVERRIDES))
        if unknown:
            raise ConfigError(f"model_overrides: {unknown} cannot be changed at start-up; allowed: "
                              f"{', '.join(MODEL_OVERRIDES)} (fields that leave the weights' shapes as they are)")
        if tc.partial_rollouts and self.env.agent:
            raise ConfigError("trainer.partial_rollouts: not supported with env.agent (an agent function's episode "
                              "runs in one call and cannot stop at a block boundary); use env.name or "
                              "trainer.partial_rollouts=false")
        if tc.max_staleness > 0 and self.ray.weight_sync != "object_store":
            raise ConfigError(f"trainer.max_staleness = {tc.max_staleness} needs ray.weight_sync=object_store "
                              f"(got {self.ray.weight_sync!r}): the rollout workers load older weight versions "
                              "from the object store")

    def check_against_model(self, model_block_size: int) -> list[str]:
        """Start-up checks that need the model: returns warnings, raises ConfigError on a block-size mismatch.

        `learner.block_size` and `rollout.decode.block_size` (unset = the model's `block_size`) must be
        equal: the learner scores a response with the block partition the sampler used, and a different
        one trains on blocks that were never sampled. Rollouts with Multi-Block Editing
        (`rollout.decode.mbe_window` > 0) rewrite finished blocks after later ones exist, a sample the
        block-causal ELBO does not represent: allowed, with a warning.
        """
        decode = DecodeConfig.preset(self.rollout.preset, **self.rollout.decode)
        learner_k = self.learner.block_size or model_block_size
        rollout_k = decode.block_size or model_block_size
        if learner_k != rollout_k:
            def origin(value):
                return "set" if value else f"unset: the model's block_size {model_block_size}"

            raise ConfigError(
                f"learner.block_size = {learner_k} ({origin(self.learner.block_size)}) differs from "
                f"rollout.decode.block_size = {rollout_k} ({origin(self.rollout.decode.get('block_size'))}): the "
                "learner would score responses with a block partition the sampler never used; set both to "
                "the same value (or leave both unset)")
        warnings = []
        if decode.mbe_window > 0:
            warnings.append(f"rollout.decode.mbe_window = {decode.mbe_window}: rollouts use Multi-Block Editing, "
                            "which rewrites finished blocks; the learner's block-causal ELBO scores the final "
                            "canvas as if each block had been written once, left to right (docs/ebpo.md)")
        return warnings

    def resolved(self) -> dict:
        """The configuration as a plain dict (what `--print-config` shows and `config.yaml` holds)."""
        return asdict(self)


# model config fields a recipe may change (`RLConfig.model_overrides`): none of them changes a weight's shape
MODEL_OVERRIDES = ("delete_token_id", "insert_token_id", "block_routing_capacity")


def model_config_of(spec: str, overrides: dict | None = None) -> LLaDA2MoeConfig:
    """The configuration of the model a recipe names, with `overrides` applied and checked (ConfigError naming
    the field); no weights are loaded."""
    path = resolve_model_path(spec)
    if path.startswith("preset:"):
        config = load_preset(path[len("preset:"):].partition("@")[0])
    else:
        config = LLaDA2MoeConfig.from_pretrained(path)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    try:
        config.validate()
    except ValueError as err:
        raise ConfigError(f"model_overrides: {err}") from None
    return config


def model_block_size(spec: str) -> int:
    """`block_size` of the model a recipe names (a folder, a shipped name or `preset:NAME[@seed]`), read from
    its configuration only (no weights are loaded)."""
    path = resolve_model_path(spec)
    if path.startswith("preset:"):
        return int(load_preset(path[len("preset:"):].partition("@")[0]).block_size)
    return int(LLaDA2MoeConfig.from_pretrained(path).block_size)
