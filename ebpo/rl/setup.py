"""Start-up of an RL run, in the order that fails cheaply: check everything, then create the run directory,
then start the actors. `start_run(cfg)` returns the `RLRun` both loops work on.

1. the configuration was built and validated whole by `load_config` (the learner section included);
   here the model (block sizes), the tokenizer, the prompt files and the rewards (one dry run on a real
   row, in-process) are checked, before anything is written;
2. the run directory is created and printed once, and `config.yaml` written;
3. Ray starts (or is joined), the actors start, a resumed run restores its latest checkpoint, tracking starts.
"""
from __future__ import annotations

import logging
from pathlib import Path

import ray
from rewards import RewardWorker, as_spec
from rewards.envs import EnvLoadError, make_environment

from ebpo.infra.checkpoint import latest_checkpoint
from ebpo.infra.config import ConfigError, to_dict
from ebpo.infra.data import tool_specs
from ebpo.infra.run_config import open_run_dir
from ebpo.infra.tracking import Tracker
from ebpo.model.loading import load_model_tokenizer, resolve_model_path
from ebpo.rl.checkpoints import restore
from ebpo.rl.cluster import Cluster, EventLog
from ebpo.rl.config import RLConfig, model_block_size, model_config_of
from ebpo.rl.launch import ray_init_kwargs, resolve_run_dir
from ebpo.rl.partial_collect import PartialLedger, collect_partial, restore_workers
from ebpo.rl.prompts import PromptSampler, Prompts, reward_input
from ebpo.rl.run_state import RLRun
from ebpo.rl.weights import PolicyWeights

log = logging.getLogger("ebpo")


def check(cfg: RLConfig) -> RLRun:
    """Step 1: everything that can be checked before a run directory exists (see the module docstring)."""
    model_spec = resolve_model_path(cfg.model)
    if cfg.rollout.tensor_parallel > 1 or cfg.rollout.expert_parallel > 1:
        check_rollout_parallel(cfg, model_spec)
    model_k = model_block_size(model_spec)
    if cfg.model_overrides:
        model_config_of(model_spec, cfg.model_overrides)  # a bad value stops here, before anything is written
    for warning in cfg.check_against_model(model_k):  # block sizes, MBE
        log.warning(warning)
    tokenizer = load_model_tokenizer(model_spec)
    # multi-turn: the environment's tools go into every prompt through the chat template (docs/rl.md)
    prompts = Prompts(cfg.data, tokenizer, environment_tools(cfg) if cfg.env.name else None)
    train_rows = prompts.load(cfg.data.train, "train")
    eval_rows = prompts.load(cfg.data.eval, "eval") if cfg.data.eval else []
    if cfg.trainer.eval_size and eval_rows:
        eval_rows = eval_rows[: cfg.trainer.eval_size]
    reward_specs = [(f.fn, f.weight, f.kwargs) for f in cfg.reward.fns]
    names = [as_spec(s).name for s in reward_specs]
    # A user's reward is checked once, in-process, on a real row, before any actor starts.
    with RewardWorker(reward_specs, num_workers=1, timeout_s=cfg.reward.timeout_s,
                      default_score=cfg.reward.default_score) as probe:
        probe.dry_run(reward_input(train_rows[0], "", cfg.data.prompt_field))
    if cfg.env.name:
        check_environment(cfg, train_rows[0])
    elif cfg.env.agent:  # agent RL: the function must import and take env.kwargs (ebpo/serve/agents.py)
        from ebpo.serve.agents import load_agent

        load_agent(cfg.env.agent, dict(cfg.env.kwargs))
    run_dir = resolve_run_dir(cfg.trainer.resume or cfg.trainer.run_dir, cfg.name)
    if cfg.trainer.resume and latest_checkpoint(run_dir) is None:
        raise ConfigError(f"trainer.resume: no checkpoint in {run_dir}/checkpoints")
    run = RLRun(cfg=cfg, run_dir=run_dir,
                tokenizer=tokenizer, prompts=prompts, train_rows=train_rows, eval_rows=eval_rows,
                sampler=PromptSampler(train_rows, cfg.trainer.seed, cfg.data.shuffle), reward_specs=reward_specs,
                reward_names=names, judge_names=[n for n, f in zip(names, cfg.reward.fns) if f.judge],
                events=EventLog(), model_spec=model_spec, block_size=cfg.learner.block_size or model_k)
    return run


def check_rollout_parallel(cfg: RLConfig, model_spec: str) -> None:
    """A parallel rollout layout (`rollout.tensor_parallel` / `rollout.expert_parallel` > 1) that the model can
    be split by and the `ParallelRolloutWorker` can run; ConfigError naming the key. The same checks as
    `ebpo plan`: heads, KV heads and experts (`RolloutConfig.check_parallel`), then everything the parallel
    model splits (vocabulary, MLP widths, FP8 blocks)."""
    from ebpo.model.parallel.layout import ParallelLayout, check_layout

    rc = cfg.rollout
    tp, ep = rc.tensor_parallel, rc.expert_parallel
    keys = f"rollout.tensor_parallel = {tp}, rollout.expert_parallel = {ep}"
    if cfg.env.agent:
        raise ConfigError(f"{keys}: env.agent runs on a one-process rollout worker only; set both to 1")
    if 0 < cfg.ray.rollout_gpus < 1:  # rank r takes device r of the GPUs Ray gives the worker
        raise ConfigError(f"ray.rollout_gpus = {cfg.ray.rollout_gpus}: a parallel rollout worker ({keys}) needs "
                          "whole GPUs, one per rank (ray.rollout_gpus = 1)")
    config = model_config_of(model_spec, cfg.model_overrides)
    rc.check_parallel(config.num_attention_heads, config.num_key_value_heads, config.num_experts or 0)
    try:
        check_layout(config, ParallelLayout(tp_size=tp, ep_size=ep, fp8=rc.fp8))
    except ValueError as err:
        raise ConfigError(f"{keys}, rollout.fp8 = {str(rc.fp8).lower()}: {err}") from None


def environment_tools(cfg: RLConfig) -> list[dict] | None:
    """The tool specs of `env.name`'s environment (`ebpo.infra.data.tool_specs`), read from one environment built
    in-process (a factory that fails stops the run with one line, as in `check_environment`)."""
    env = _build_environment(cfg)
    try:
        return tool_specs(env)
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()


def _build_environment(cfg: RLConfig):
    try:
        return make_environment(cfg.env.name, dict(cfg.env.kwargs))
    except EnvLoadError:
        raise
    except Exception as err:  # the factory itself failed (bad kwargs, a bug in the user's code)
        raise EnvLoadError(f"env.name = {cfg.env.name!r}: building it with env.kwargs = {dict(cfg.env.kwargs)} "
                           f"failed: {type(err).__name__}: {err}") from None


def check_environment(cfg: RLConfig, row: dict) -> None:
    """Build one environment of `env.name` with `env.kwargs` and reset it on a real row, in-process, before any
    actor starts: a bad reference, bad keyword arguments or a `reset` that raises stop the run here with
    one line (`rewards.envs.EnvLoadError`)."""
    env = _build_environment(cfg)
    try:
        env.reset(row, 0)
    except Exception as err:
        raise EnvLoadError(f"env.name = {cfg.env.name!r}: reset() on the first training row failed: "
                           f"{type(err).__name__}: {err}") from None
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()


def start_run(cfg: RLConfig) -> RLRun:
    """Check, create the run directory, start the actors, restore a checkpoint when resuming (module docstring)."""
    run = check(cfg)
    # everything is checked: only now is anything written (a bad key leaves no run directory behind); a
    # resume never rewrites config.yaml and refuses changes to what the run learns (ebpo/infra/run_config.py)
    open_run_dir(run.run_dir, to_dict(cfg), resume=bool(cfg.trainer.resume), allowed=cfg.trainer.resume_changes)
    print(f"ebpo: run directory {run.run_dir}", flush=True)
    if cfg.model_overrides:
        run.model_spec = write_init_model(run.model_spec, cfg.model_overrides, run.run_dir / "init_model")
    if not ray.is_initialized():
        ray.init(**ray_init_kwargs(cfg.ray, run.events))
    run.weights = PolicyWeights(ray, cfg.ray, run.events)  # learner -> rollout workers
    run.cluster = Cluster(cfg, run.model_spec, run.reward_specs, run.events)
    run.cluster.start(run.weights.restart_weights)
    run.weights.attach(run.cluster.learner, run.cluster.rollout_workers)
    if cfg.trainer.partial_rollouts:  # the rollout path, chosen once
        run.partial, run.collector = PartialLedger(), collect_partial
    run_id = None
    if cfg.trainer.resume:
        run_id = restore(run)
        run.resumed = True
    run.tracker = Tracker(run.run_dir, to_dict(cfg), project=cfg.trainer.wandb_project, mode=cfg.trainer.tracking,
                          run_id=run_id)
    if run.start_step == 0:
        run.tracker.log(run.prompts.metrics, step=0)
    return run


def write_init_model(spec: str, overrides: dict, out: Path) -> str:
    """The initial policy `spec` with `RLConfig.model_overrides` applied, saved to `out` (weights, config and
    tokenizer); returns `out`, the model the learner and the rollout workers then load. Block routing is switched
    with `set_block_routing` (config and every MoE gate); the other fields are config only. The whole model is
    loaded once in the driver to write it: cheap for the tiny models, a copy of the weights for large ones."""
    from ebpo.model.loading import load_model
    from ebpo.model.routing import set_block_routing

    model = load_model(spec)
    for key, value in overrides.items():
        if key == "block_routing_capacity":
            set_block_routing(model, int(value))
        else:
            setattr(model.config, key, value)
    model.config.validate()
    model.save_pretrained(str(out))
    load_model_tokenizer(spec).save_pretrained(str(out))
    return str(out)


def rebuild_learner(run: RLRun, err: Exception) -> int:
    """A learner rank died: a new learner group, restored (with the sampler and weight version) from the
    latest checkpoint, or from the initial policy if there is none; returns the step to continue after.
    The caller brings the rollout workers to the restored weights as its loop does."""
    run.weights.detach()  # the object-store parts of the last sync died with their owner (the old rank 0)
    run.weights.attach(run.cluster.new_learner(err), run.cluster.rollout_workers)
    if latest_checkpoint(run.run_dir) is not None:
        events = list(run.events)
        restore(run)
        run.events[:] = events  # the checkpoint's list predates this failure
        return run.start_step
    run.sampler.restore({"epoch": 0, "position": 0})
    run.weights.reset()
    run.start_step, run.in_flight = 0, []
    if run.partial is not None:  # back to the start: nothing in flight anywhere
        run.partial = PartialLedger()
        restore_workers(run, None)
    return 0
