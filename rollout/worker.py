"""`RolloutWorker`: a Ray-actor-ready holder of one policy copy that runs the draft-and-edit decoder.

The trainer wraps it with `ray.remote(...)`; it is a plain class so tests and single-process tools can
use it directly. Weights arrive from the learner as a state_dict, through the object store
(`load_weights`) or a bucketed broadcast (`join_sync_group` + `receive_weights`), and are loaded in
place; with `fp8=True` the linear layers and experts run the per-block FP8 kernels and every sync
re-quantises them.

Multi-turn (agentic) rollouts: with `env_factory` (a picklable zero-argument callable that builds one
environment; the driver passes `functools.partial(rewards.envs.make_environment, name, kwargs)`, so this
package never imports `rewards`) and `multiturn` (`MultiTurnConfig` fields), `generate(..., rows=...)`
resets one environment per prompt with its dataset row and runs `rollout.multiturn.generate_multiturn`.
"""
from __future__ import annotations

import time

import torch

from ebpo.model.loading import load_model, load_model_tokenizer


class RolloutWorker:
    def __init__(self, model: str, decode: dict, *, num_threads: int | None = None, fp8: bool = False,
                 device: str = "cpu", weights=None, weights_version: int = 0, env_factory=None,
                 multiturn: dict | None = None):
        """model: folder / `tiny-sft` / `preset:NAME[@seed]`; decode: DecodeConfig fields (incl. `preset`).

        `weights` (a state_dict or `WeightParts`) lets a restarted worker come back with the policy it had,
        not the base model. `env_factory` / `multiturn`: multi-turn rollouts (module docstring).
        """
        if num_threads:
            torch.set_num_threads(num_threads)
        from . import DecodeConfig

        decode = dict(decode)
        self.decode_config = DecodeConfig.preset(decode.pop("preset", "speed"), **decode)
        self.env_factory = env_factory
        self.multiturn = dict(multiturn or {})
        self.device = torch.device(device)
        self.model = load_model(model, device=self.device).eval()
        self.tokenizer = load_model_tokenizer(model)
        self.fp8 = False  # until the float weights are loaded and the model converted below
        self.version = 0
        self.sync_group = None  # rollout.weight_sync.WeightBroadcastGroup with ray.weight_sync=broadcast
        self.partial = None  # rollout.partial.PartialRollouts: sequences carried between steps
        self.env_runner = None  # its environments' step threads (rollout.env_steps.StepRunner)
        self.engines = None  # rollout.engine_holder.EngineHolder: the worker's one engine, built on first use
        if weights is not None:
            self.load_weights(weights, weights_version)
        if fp8:
            from kernels.fp8 import convert_model_to_fp8

            self.model = convert_model_to_fp8(self.model)
        self.fp8 = fp8

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], decode: dict | None = None,
                 rows: list[dict] | None = None) -> list[dict]:
        """Decode each prompt (token-id list) with its own seed; returns plain dicts (cheap to ship over Ray).

        `decode` (DecodeConfig fields incl. `preset`) replaces the worker's rollout config for this call,
        e.g. greedy Quality Mode for evaluation. `rows` (one dataset row per prompt): multi-turn rollouts
        against the worker's environment (each dict then also holds `trajectory`, `Trajectory.to_dict()`).
        """
        from . import DecodeConfig, generate

        config = self.decode_config
        if decode is not None:
            decode = dict(decode)
            config = DecodeConfig.preset(decode.pop("preset", "quality"), **decode)
        if rows is not None:
            return self._generate_turns(prompt_ids, seeds, config, rows)
        with torch.no_grad():
            outs = generate(self.model, prompt_ids, config, tokenizer=self.tokenizer, seeds=seeds,
                            engines=self._engines())
        return [_single_turn_sample(o, self.version) for o in outs]

    def _generate_turns(self, prompt_ids: list[list[int]], seeds: list[int], config, rows: list[dict]) -> list[dict]:
        """Multi-turn rollouts: one fresh environment per prompt, reset with its row and seed, then
        `generate_multiturn`; the sample's response is everything after the prompt (turns and observations),
        its text the last turn's (what a reward judges as the final answer)."""
        from .multiturn import MultiTurnConfig, run_episodes

        if self.env_factory is None:
            raise ValueError("RolloutWorker.generate: rows given (multi-turn) but the worker has no env_factory")
        if len(rows) != len(prompt_ids):
            raise ValueError(f"RolloutWorker.generate: one row per prompt ({len(prompt_ids)}), got {len(rows)}")
        trajs = run_episodes(self.model, prompt_ids, rows, self.env_factory, config, MultiTurnConfig(**self.multiturn),
                             tokenizer=self.tokenizer, seeds=seeds, engines=self._engines())
        return [_multi_turn_sample(t, self.version) for t in trajs]

    def generate_partial(self, prompt_ids: list[list[int]], seeds: list[int], tags: list, quota: int,
                         min_version: int | None = None, rows: list[dict] | None = None,
                         due_version: int | None = None) -> dict:
        """Partial rollouts (`rollout.partial`): start these prompts (one group key per prompt; members of a
        group must all come to this worker), continue the sequences carried over from earlier calls under the
        weights held now, and decode until `quota` groups are complete; the others stop at a block boundary
        and wait for the next call. `min_version`: sequences whose oldest block is older are dropped (and
        counted); `due_version`: groups holding a sequence whose oldest block is older are waited for and
        returned beyond the quota (`PartialRollouts.collect`). Returns {"samples": [sample dicts with "tag" and
        "block_versions"], "stats": CollectStats fields, "held": the group keys still in flight here,
        "dropped_tags": the groups dropped}; a sample's `weights_version` is its oldest block's version."""
        from dataclasses import asdict

        from .decoder import _make_generators, _output
        from .engine import eos_ids_of
        from .multiturn import MultiTurnConfig, start_episodes, trajectory_of
        from .partial import NewSequence, PartialRollouts, close_env

        if self.partial is None:
            self.partial = PartialRollouts()
        cfg, mt, envs = self.decode_config, None, [None] * len(prompt_ids)
        if rows is not None:
            mt = MultiTurnConfig(**self.multiturn)
            envs = [self.env_factory() for _ in prompt_ids]
            prompt_ids = start_episodes(envs, rows, prompt_ids, self.tokenizer, seeds, mt.observation_template)
            if self.env_runner is None:
                from .env_steps import StepRunner

                self.env_runner = StepRunner(mt.max_workers)
        gens = _make_generators(len(prompt_ids), seeds, None, cfg.temperature, self.device) or [None] * len(prompt_ids)
        new = [NewSequence(p, g, t, e) for p, g, t, e in zip(prompt_ids, gens, tags, envs)]
        K = cfg.block_size or self.model.config.block_size
        with torch.no_grad():
            seqs, stats = self.partial.collect(self.model, cfg, new, quota, self.version, max_batch=cfg.max_batch,
                                               min_version=min_version, due_version=due_version,
                                               tokenizer=self.tokenizer, mt=mt,
                                               runner=self.env_runner, engines=self._engines())
        samples = []
        for s in seqs:
            if s.env is None:
                d = _single_turn_sample(_output(s, eos_ids_of(self.model.config), self.tokenizer, K), s.oldest_version())
            else:
                d = _multi_turn_sample(trajectory_of(s, 0.0, K), s.oldest_version())
                close_env(s.env)
            d.update(tag=s.tag, block_versions=s.versions_by_block())
            samples.append(d)
        return {"samples": samples, "stats": asdict(stats), "held": list(self.partial.group_sizes),
                "dropped_tags": sorted(self.partial.dropped_tags, key=str)}

    def partial_state(self) -> dict | None:
        """The in-flight partial rollouts (a checkpoint), or None. A group with an environment that does not
        pickle is left out (it goes on here; a resumed run counts it as lost)."""
        import pickle

        if self.partial is None:
            return None
        state = self.partial.state()
        bad = set()
        for s in state["carried"] + state["done"]:
            try:
                pickle.dumps(s)
            except Exception:  # noqa: BLE001 - an environment that does not pickle
                bad.add(s.tag)
        if bad:
            state = {"group_sizes": {t: n for t, n in state["group_sizes"].items() if t not in bad},
                     "carried": [s for s in state["carried"] if s.tag not in bad],
                     "done": [s for s in state["done"] if s.tag not in bad]}
        return state

    def restore_partial(self, state: dict | None) -> None:
        """Continue from a `partial_state` (None: no partial rollouts in flight); sequences the worker's engine
        held for the state it replaces are released."""
        from .partial import PartialRollouts

        if self.engines is not None and self.engines.engine is not None:
            self.engines.engine.export()  # what the engine held for the replaced state leaves its slots
        self.partial = None if state is None else PartialRollouts.from_state(state)

    def _engines(self):
        """The worker's one rollout engine (`rollout.engine_holder`), built on first use, after any FP8 conversion."""
        if self.engines is None:
            from .engine_holder import EngineHolder

            self.engines = EngineHolder(self.model, self.version)
        return self.engines

    def _new_version(self, version: int) -> None:
        self.version = version
        if self.engines is not None:
            self.engines.set_version(version)

    def load_weights(self, state_dict, version: int) -> float:
        """Load a learner state_dict (stacked-expert names or released names), or a
        `rollout.weight_sync.WeightParts` (one object-store reference per bucket, fetched and loaded one
        at a time so that the extra memory is one bucket); returns seconds taken."""
        from .weight_sync import WeightParts

        start = time.perf_counter()
        if isinstance(state_dict, WeightParts):
            import ray

            from .weight_loading import StreamingWeightLoader

            loader = StreamingWeightLoader(self.model, self.fp8)
            for ref in state_dict.refs:
                loader.load_part(ray.get(ref))
            loader.finish()
        elif self.fp8:
            from kernels.fp8 import requantize_model_

            requantize_model_(self.model, state_dict)
        else:
            self.model.load_state_dict(state_dict, strict=True)
        self._new_version(version)
        return time.perf_counter() - start

    def join_sync_group(self, addr: str, port: int, rank: int, world_size: int, timeout_s: float,
                        device: str = "cpu") -> None:
        """Join the learner's broadcast group as `rank` (>= 1); blocks until every member joined."""
        from rollout.weight_sync import WeightBroadcastGroup

        self.close_sync_group()
        self.sync_group = WeightBroadcastGroup(addr, port, rank, world_size, timeout_s=timeout_s, device=device)

    def receive_weights(self, version: int) -> float:
        """Receive the learner's broadcast of `version`, loading each bucket (FP8 layers re-quantised) as it
        arrives so that the extra memory is one bucket; returns seconds taken, receiving included."""
        if self.sync_group is None:
            raise RuntimeError("receive_weights: this rollout worker is in no weight-sync group")
        from .weight_loading import StreamingWeightLoader

        start = time.perf_counter()
        loader = StreamingWeightLoader(self.model, self.fp8)
        self.sync_group.receive(version, consume=loader.load_part)
        loader.finish()
        self._new_version(version)
        return time.perf_counter() - start

    def close_sync_group(self) -> None:
        if self.sync_group is not None:
            self.sync_group.close()
            self.sync_group = None

    def weights_digest(self) -> dict:
        """SHA-256 and counts of the policy's state_dict; equals the learner's `weights_digest()` after a sync
        when `fp8` is off (FP8 layers hold re-quantised weights, not the learner's)."""
        from rollout.weight_sync import state_dict_digest

        return state_dict_digest(self.model.state_dict())

    def ping(self) -> int:
        """Liveness check; returns the weights version held."""
        return self.version


def _single_turn_sample(o, version: int) -> dict:
    """A `GenerationOutput` as the plain dict `RolloutSample` is built from (cheap to ship over Ray)."""
    return {"token_ids": list(o.token_ids), "text": o.text, "num_forwards": o.num_forwards, "tpf": o.tpf,
            "num_edits": o.num_edits, "finished_by_eos": o.finished_by_eos, "tail_ids": list(o.tail_ids),
            "edit_log": [list(e) for e in o.edit_log],
            "lev_drafts": [[off, list(d)] for off, d in o.lev_drafts],  # L-EBPO's pre-edit blocks
            "weights_version": version}  # the policy that sampled it (asynchronous RL's staleness)


def _multi_turn_sample(t, version: int) -> dict:
    """A multi-turn `Trajectory` as a sample dict: the response is everything after the prompt (turns and
    observations), the text the last turn's (what a reward judges as the final answer)."""
    response = t.ids[len(t.prompt_ids):]
    last = t.turns[-1] if t.turns else None
    return {"token_ids": response, "text": last.text if last else "", "num_forwards": t.num_forwards,
            "tpf": t.num_generated / max(t.num_forwards, 1), "num_edits": t.num_edits,
            "finished_by_eos": bool(last and last.finished_by == "eos"),
            "weights_version": version, "trajectory": t.to_dict(),
            # L-EBPO's pre-edit blocks, offsets from the end of the trajectory's prompt_ids
            "lev_drafts": [[off, list(d)] for off, d in getattr(t, "lev_drafts", [])]}
