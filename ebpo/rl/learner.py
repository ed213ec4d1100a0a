"""EBPO learner worker: old composites, mu epochs x minibatches of the clipped surrogate with gradient replay.

A plain Python class; the trainer wraps it with `ray.remote`. Backends: plain torch (AdamW) or DeepSpeed
(ZeRO 1/2/3; on CPU it needs `torch.distributed` with gloo, which `_init_dist` starts with world size 1).
Optional PEFT LoRA: the reference policy is then the base model with the adapter disabled. LoRA wraps
`nn.Linear` modules only, so it reaches attention (`query_key_value`, `dense`), the dense MLP of the
first layers and the shared experts; routed experts are stacked `nn.Parameter`s and stay frozen.

Batch: an `ebpo.rl.records.LearnerBatch` (or a dict of its fields, converted by
`LearnerBatch.from_mapping`): `input_ids` (B, L), `prompt_lens` (B,), `response_mask` (B, L) bool,
`advantages` (B,) already normalised per prompt group, `weight_version` (B,) in asynchronous RL, and
`block_versions` (B, nb) when partial rollouts decoded a row under several versions.
Public API for the other learner modules: `micro_inputs`, `composites`, `sum_over_ranks`, `micro_steps`.
"""
from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Mapping, Union

import peft
import torch

from ebpo.model import enable_activation_checkpointing
from ebpo.core.algos import ebpo_loss
from ebpo.core.offpolicy import decoupled_ebpo_loss
from ebpo.infra.distributed import all_reduce_grads, init_distributed
from ebpo.rl.learner_config import LORA_TARGETS, LearnerConfig, lr_factor  # noqa: F401 (re-exported)
from ebpo.rl.async_behaviour import BehaviourSnapshots, behaviour_of_rows, prepare_behaviour
from ebpo.rl.learner_steps import UpdateState, micro_steps
from ebpo.rl.records import LearnerBatch
from ebpo.rl.sharding import balance_by_tokens, loss_weight, padded_lengths, token_microbatches
from ebpo.rl.weight_stream import WeightStreamer
from ebpo.core.editing import editing_draws, t2t_stats
from ebpo.core import lev_likelihood
from ebpo.core.likelihood import all_composites, direct_backward, draw_noise, replay_backward
from ebpo.model.loading import load_model


class PolicyForward:
    """What the likelihood functions need: `__call__` (through the engine, so its hooks run) and the LM head."""

    def __init__(self, call, module):
        self._call, self._module = call, module

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def get_output_embeddings(self):
        return self._module.get_output_embeddings()

    @property
    def config(self):
        return self._module.config


def autocast_call(module, device_type: str):
    """`module(...)` run under bf16 autocast on `device_type`."""
    def call(*args, **kwargs):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return module(*args, **kwargs)
    return call


class EBPOLearner:
    """EBPO policy learner. `update(batch)` runs one RL step's optimisation and returns metrics."""

    def __init__(self, model_or_path, config: LearnerConfig | None = None, **overrides):
        cfg = config or LearnerConfig()
        if overrides:  # a config built here is checked here; one from a recipe was checked when it was built
            cfg = LearnerConfig(**{**asdict(cfg), **overrides})
            cfg.validate()
        self.cfg = cfg
        if isinstance(model_or_path, str):
            model_or_path = load_model(model_or_path)
        base = model_or_path
        self.model_config = base.config
        self.block_size = cfg.block_size or base.config.block_size
        self.mask_id = base.config.mask_token_id
        self.eos_id = base.config.eos_token_id
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(base)
        if cfg.backend == "torch":
            dev = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            base = base.to(dev)
        self.ref_model = None
        if cfg.lora.enabled:
            self.model = peft.get_peft_model(base, cfg.lora.peft_config())
        else:
            self.model = base
            if cfg.kl_beta > 0:  # frozen reference = the initial policy
                self.ref_model = copy.deepcopy(base).eval().requires_grad_(False)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        self.engine = None
        n_backward = math.ceil(cfg.n_draws / cfg.replay_chunk) if cfg.grad_replay else 1
        self._n_backward = n_backward
        # Several ranks: the process group was formed by the caller (LearnerActor) or a launcher; one rank
        # computes every collective with the others, so all of them run `update` on the same batch.
        if cfg.num_workers > 1 or cfg.backend == "deepspeed":
            init_distributed()
        self.world_size = torch.distributed.get_world_size() if cfg.num_workers > 1 else 1
        self.rank = torch.distributed.get_rank() if cfg.num_workers > 1 else 0
        if self.world_size != cfg.num_workers:
            raise ValueError(f"learner.num_workers={cfg.num_workers} but the process group has {self.world_size} "
                             "ranks")
        if cfg.backend == "deepspeed":
            import deepspeed  # here, not at the top: importing it is slow and probes the accelerator

            zero = {"stage": cfg.zero_stage}
            if cfg.offload_optimizer:
                zero["offload_optimizer"] = {"device": "cpu"}
            if cfg.offload_param:
                zero["offload_param"] = {"device": "cpu"}
            ds_config = {
                "train_micro_batch_size_per_gpu": 1,
                # One optimizer step per minibatch = one "micro step" per replayed draw chunk and micro-batch;
                # `_step_backward` marks the last one as the accumulation boundary, and we scale the losses
                # ourselves (scale_wrt_gas=False), so gradients are the exact sum.
                "gradient_accumulation_steps": n_backward,
                "gradient_clipping": cfg.grad_clip,
                "zero_optimization": zero,
                "bf16": {"enabled": cfg.dtype == "bf16"},
                "steps_per_print": 10 ** 9,
                "wall_clock_breakdown": False,
            }
            if cfg.offload_optimizer:
                # DeepSpeed's CPU Adam needs a compiled extension; torch's AdamW on the offloaded states is exact.
                ds_config["zero_force_ds_cpu_optimizer"] = False
            self.engine, self.optimizer, _, _ = deepspeed.initialize(model=self.model, optimizer=self.optimizer,
                                                                     config=ds_config)
            self.fwd = PolicyForward(self.engine, self.model)
        elif cfg.dtype == "bf16":
            # fp32 weights stay the master copy; matmuls run in bf16. `gathered_logprobs` turns autocast off
            # for the LM head and log-softmax, and composites are summed in fp32.
            dev_type = next(self.model.parameters()).device.type
            self.fwd = PolicyForward(autocast_call(self.model, dev_type), self.model)
        else:
            self.fwd = PolicyForward(self.model, self.model)
        self.device = next(self.model.parameters()).device
        self.generator = torch.Generator().manual_seed(cfg.seed or 0)  # unset: a learner built on its own
        self.updates_done = 0
        self.snapshots = BehaviourSnapshots(cfg.max_staleness)  # past weight versions (asynchronous RL)
        self.lr_now = cfg.lr * lr_factor(0.0, cfg)

    @property
    def gathers_weights(self) -> bool:
        """True when reading the full weights is a collective over the ranks (DeepSpeed ZeRO-3, no LoRA)."""
        return self.engine is not None and self.cfg.zero_stage == 3 and not self.cfg.lora.enabled

    # ------------------------------------------------------------------------------------------------
    def _ref_context(self):
        if self.cfg.lora.enabled:
            return self.model.disable_adapter()
        return nullcontext()

    def _ref_forward(self):
        if self.ref_model is not None:
            return PolicyForward(self.ref_model, self.ref_model)
        return self.fwd

    def _set_lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = value
        self.lr_now = value

    def _backward(self, t: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.backward(t, scale_wrt_gas=False)
        else:
            t.backward()

    def _optimizer_step(self, state: UpdateState, loss_finite: bool = True) -> float:
        """Clip, step, zero grads; returns the pre-clip global grad norm.

        A step whose loss (`loss_finite` False) or grad norm is not finite is skipped (gradients dropped,
        weights and optimizer state untouched) and counted in `state.nonfinite` (`actor/nonfinite_steps`).
        """
        if self.engine is not None:
            # engine.step() is a no-op until the accumulation boundary; our backward calls per
            # minibatch equal gradient_accumulation_steps, so the last one triggers the real step.
            # DeepSpeed ZeRO skips a step whose gradient norm is inf/NaN itself (fp32; bf16 only with its
            # overflow check on) and reports the norm as inf: counted here.
            norm = self.engine.get_global_grad_norm() if hasattr(self.engine, "get_global_grad_norm") else None
            norm = float(norm) if norm is not None else float("nan")
            state.nonfinite += int(not (loss_finite and math.isfinite(norm)))
            return norm
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.world_size > 1:
            all_reduce_grads(params)
        if self.cfg.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        if not (loss_finite and math.isfinite(float(norm))):  # NaN would reach the weights and Adam's moments
            state.nonfinite += 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ------------------------------------------------------------------------------------------------
    def _check_batch(self, batch: Union[LearnerBatch, Mapping]) -> tuple[LearnerBatch, torch.Tensor, torch.Tensor]:
        """The batch as a checked record (a dict is converted: `LearnerBatch.from_mapping`), each row's
        response length (B,) fp32 and prompt + response length (B,) long."""
        b = batch if isinstance(batch, LearnerBatch) else LearnerBatch.from_mapping(batch, self.eos_id)
        resp, L = b.response_mask, b.input_ids.shape[1]
        # prompt + response length of each row: the last response position + 1 (the prompt alone if empty)
        last = L - resp.flip(1).to(torch.uint8).argmax(1)
        seq_lens = torch.where(resp.any(1), last, b.prompt_lens.clamp(max=L))
        return b, resp.sum(1).float(), seq_lens

    def composites(self, fwd, ids: torch.Tensor, noise, chunk: int, cached: bool, blocks: bool = False):
        """No-grad composites (B, N) of micro-batch inputs `ids` (b, l) under `fwd` (the live policy, or the
        reference); with blocks=True also the per-block values (b, N, nb)."""
        return all_composites(fwd, ids, noise, self.mask_id, packed=self.cfg.packed, chunk=chunk,
                              return_blocks=blocks, use_module_head=self.cfg.zero_stage == 3 and self.engine is not None,
                              cached=cached)

    def update(self, batch: Union[LearnerBatch, Mapping]) -> dict:
        """One RL step: old (and ref) composites without grad, then mu epochs x minibatches of EBPO.

        Every rank of a learner group calls it with the same batch: noise draws and minibatch order come
        from the learner seed over the whole batch (independent of W), each rank scores its token-balanced
        share of every minibatch (`ebpo.rl.sharding`), in token-budget micro-batches, and gradients are
        summed over ranks with the loss normalised by the whole minibatch.
        Returns `actor/*` metrics (means over minibatch steps; log_ratio_max is the max), per-block
        likelihood stats `likelihood/*` of the old policy, and `timing_s/{old_logprob,update}`.
        """
        cfg = self.cfg
        b, lengths, seq_lens = self._check_batch(batch)
        dev = self.device
        ids, resp = b.input_ids.to(dev), b.response_mask
        adv, lengths = b.advantages.to(dev), lengths.to(dev)
        B = ids.shape[0]
        noise = draw_noise(resp, self.block_size, cfg.n_draws, cfg.t_min, cfg.t_max, self.generator, cfg.noise)
        if cfg.t2t_weight > 0:  # a generator of its own: the M2T draws and minibatch order stay the mask-only ones
            noise = editing_draws(noise, ids, resp, rate=cfg.t2t_rate, weight=cfg.t2t_weight, source=cfg.t2t_source,
                                  seed=cfg.seed or 0, update=self.updates_done, model=self.fwd,
                                  model_config=self.model_config)
        if cfg.levenshtein:  # L-EBPO: edit labels per draw from the rollouts' pre-edit drafts
            noise = lev_likelihood.learner_draws(noise, ids, resp, b.prompt_lens, b.lev_drafts, self.model_config,
                                                 cfg.levenshtein_weight)
        perm = torch.randperm(B, generator=self.generator)
        mbs = list(perm.split(cfg.minibatch_size or B))
        if min(len(mb) for mb in mbs) < self.world_size:
            raise ValueError(f"learner: a minibatch of {min(len(mb) for mb in mbs)} sequences cannot be split "
                             f"over learner.num_workers={self.world_size} ranks; raise learner.minibatch_size")
        tokens = padded_lengths(seq_lens, self.block_size)
        plans = [self._plan(mb, tokens) for mb in mbs]
        # Current values inside replay use `nograd_chunk`; direct backprop uses one forward of all draws.
        # Old values use the same chunking so that at the first step current == old bit for bit.
        chunk = cfg.nograd_chunk if cfg.grad_replay else 0
        state = UpdateState(cached=cfg.nograd_cached and cfg.grad_replay)
        # On-policy shortcut: with one epoch over one minibatch and no reference, the old composites
        # are the current ones of the same draws (same chunking: bit for bit), so the update's own
        # forward supplies them instead of a separate no-grad pass (ratio 1, identical gradient).
        on_policy = cfg.mu == 1 and len(mbs) == 1 and cfg.kl_beta == 0
        t0 = time.perf_counter()
        old = torch.zeros(B, cfg.n_draws, device=dev)
        blocks = torch.zeros(B, cfg.n_draws, noise.t.shape[-1], device=dev)
        ref = torch.zeros(B, cfg.n_draws, device=dev) if cfg.kl_beta > 0 else None
        # ZeRO-3 gathers parameters collectively in every forward: all ranks run n_micro forwards, a rank
        # with fewer micro-batches repeats one row and discards the result.
        pad = self.engine is not None and self.world_size > 1
        with torch.no_grad():
            for plan in ([] if on_policy else plans):
                for rows, real, _ in micro_steps(plan, pad):
                    mb_ids, mb_noise = self.micro_inputs(ids, noise, rows, tokens)
                    c, blk = self.composites(self.fwd, mb_ids, mb_noise, chunk, state.cached, blocks=True)
                    r = None
                    if ref is not None:
                        with self._ref_context():
                            r = self.composites(self._ref_forward(), mb_ids, mb_noise, chunk, state.cached)
                    if real:
                        old[rows.to(dev)] = c
                        blocks[rows.to(dev), :, : blk.shape[-1]] = blk
                        if ref is not None:
                            ref[rows.to(dev)] = r
            if not on_policy:
                self.sum_over_ranks(old, blocks, *([ref] if ref is not None else []))
        # None unless asynchronous
        behaviour = prepare_behaviour(self, b.weight_version, ids, noise, plans, tokens, chunk, state.cached,
                                      block_versions=b.block_versions)
        t_old = time.perf_counter() - t0

        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        lr_max, n_steps, n_total = 0.0, 0, cfg.mu * len(mbs)
        for _ in range(cfg.mu):
            for j in torch.randperm(len(mbs), generator=self.generator).tolist():
                self._set_lr(cfg.lr * lr_factor(self.updates_done + n_steps / n_total, cfg, 1.0 / n_total))
                parts = []  # (rows, metrics) of this rank's micro-batches
                # DeepSpeed reduces gradients inside every backward, so all ranks run n_micro of them; a rank
                # with fewer micro-batches repeats one row with weight 0.
                for rows, real, last in micro_steps(plans[j], pad=True):
                    weight = loss_weight(len(rows), len(mbs[j])) if real else 0.0
                    if self.engine is not None:
                        weight *= self.world_size  # DeepSpeed averages gradients over ranks; we want the sum
                    m, cur = self._micro_step(state, ids, noise, rows, tokens, old, adv, lengths, ref, weight,
                                              on_policy, last=last, behaviour=behaviour)
                    if on_policy and real:  # the behaviour policy's values, for the likelihood stats
                        old[rows.to(dev)] = cur[0].to(dev)
                        blocks[rows.to(dev), :, : cur[1].shape[-1]] = cur[1].to(dev)
                    if real:
                        parts.append((len(rows), m))
                m = self._reduce_metrics(parts, len(mbs[j]))
                m["grad_norm"] = self._optimizer_step(state, math.isfinite(m["pg_loss"]) and math.isfinite(m["kl"]))
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                lr_max = max(lr_max, m["log_ratio_max"])
                n_steps += 1
        if on_policy:
            self.sum_over_ranks(old, blocks)
        self.updates_done += 1
        metrics = {f"actor/{k}": v / n_steps for k, v in sums.items()}
        metrics["actor/log_ratio_max"] = lr_max
        metrics["actor/lr"] = self.lr_now
        metrics["actor/nonfinite_steps"] = float(state.nonfinite)  # a count per update, not a mean
        metrics.update(self._likelihood_stats(old, blocks, noise, resp, lengths), **t2t_stats(noise),
                       **lev_likelihood.lev_stats(noise, self.model_config))
        metrics["timing_s/old_logprob"] = t_old
        metrics["timing_s/update"] = time.perf_counter() - t0
        return metrics

    def _micro_step(self, state: UpdateState, ids, noise, rows, tokens, old, adv, lengths, ref, weight: float,
                    on_policy: bool, last: bool, behaviour=None):
        """Forward and backward of one micro-batch `rows`; its loss is the EBPO loss of these rows times
        `weight`. Returns (metrics of the rows, composites (C, blocks) of the rows or C)."""
        cfg, dev = self.cfg, self.device
        rows_d = rows.to(dev)
        mb_old, mb_adv = old[rows_d], adv[rows_d]
        mb_len = lengths[rows_d] if cfg.length_normalize else None
        mb_ref = ref[rows_d] if ref is not None else None

        def loss_fn(cur):
            prox, kw = cur.detach() if on_policy else mb_old, dict(lengths=mb_len, ref=mb_ref, kl_beta=cfg.kl_beta,
                                                                   kl_estimator=cfg.kl_estimator, dual_clip=cfg.dual_clip)
            # asynchronous (behaviour given): clip against the proximal, weight each row behaviour -> proximal
            loss, m = (ebpo_loss(cur, prox, mb_adv, cfg.eps_low, cfg.eps_high, **kw) if behaviour is None else
                       decoupled_ebpo_loss(cur, prox, behaviour_of_rows(behaviour, rows, prox), mb_adv, cfg.eps_low,
                                           cfg.eps_high, cfg.is_cap, **kw))
            return (loss if weight == 1.0 else loss * weight), m

        mb_ids, mb_noise = self.micro_inputs(ids, noise, rows, tokens)
        state.backwards_left, state.last_micro = self._n_backward, last
        zero3 = cfg.zero_stage == 3 and self.engine is not None

        def backward(t: torch.Tensor) -> None:
            self._step_backward(state, t)

        if cfg.grad_replay:
            _, m, cur = replay_backward(self.fwd, mb_ids, mb_noise, self.mask_id, loss_fn,
                                        backward=backward, packed=cfg.packed,
                                        nograd_chunk=cfg.nograd_chunk, replay_chunk=cfg.replay_chunk,
                                        use_module_head=zero3, cached=state.cached, return_blocks=on_policy)
        else:
            _, m, cur = direct_backward(self.fwd, mb_ids, mb_noise, self.mask_id, loss_fn,
                                        backward=backward, packed=cfg.packed,
                                        use_module_head=zero3, return_blocks=on_policy)
        return m, cur

    def _plan(self, mb: torch.Tensor, tokens: torch.Tensor) -> tuple[list[torch.Tensor], int]:
        """This rank's micro-batches of minibatch `mb` and the number of micro-steps every rank runs."""
        shares = balance_by_tokens(mb, tokens, self.world_size)
        per_rank = [token_microbatches(share, tokens, self.cfg.max_tokens_per_microbatch) for share in shares]
        return per_rank[self.rank], max(len(m) for m in per_rank)

    def micro_inputs(self, ids: torch.Tensor, noise, rows: torch.Tensor, tokens: torch.Tensor):
        """Input ids (b, l) and noise draws of micro-batch `rows` of the batch `ids` (B, L); with a token
        budget, cut to their longest padded length l (`tokens` (B,): each row's length in whole blocks)."""
        if self.cfg.max_tokens_per_microbatch <= 0:
            return ids[rows.to(ids.device)], noise.rows(rows)
        length = int(tokens[rows].max())
        return ids[rows.to(ids.device), :length], noise.take(rows, length)

    def sum_over_ranks(self, *tensors: torch.Tensor) -> None:
        """In place: every rank filled only its own rows (zeros elsewhere); the sum gives all rows to all."""
        if self.world_size > 1:
            for t in tensors:
                torch.distributed.all_reduce(t)

    def _reduce_metrics(self, parts: list[tuple[int, dict]], rows_in_minibatch: int) -> dict:
        """Minibatch metrics from this rank's micro-batches (and the other ranks'): row-weighted means, the
        max for *_max keys (log_ratio_max) and the min for *_min keys. One part covering the whole minibatch
        is returned unchanged."""
        if self.world_size == 1 and len(parts) == 1:
            return dict(parts[0][1])
        keys = sorted(parts[0][1])
        sums = torch.tensor([[n * m[k] for k in keys] for n, m in parts], dtype=torch.float64).sum(0)
        ext = [(k, 1.0 if k.endswith("_max") else -1.0) for k in keys if k.endswith(("_max", "_min"))]
        top = torch.tensor([max(sign * m[k] for _, m in parts) for k, sign in ext], dtype=torch.float64)  # min = -max(-x)
        if self.world_size > 1:
            torch.distributed.all_reduce(sums)
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
        out = {k: float(v) / rows_in_minibatch for k, v in zip(keys, sums.tolist())}
        out.update({k: sign * float(v) for (k, sign), v in zip(ext, top.tolist())})
        return out

    def _step_backward(self, state: UpdateState, t: torch.Tensor) -> None:
        state.backwards_left -= 1
        if self.engine is not None:
            # the last backward of the minibatch's last micro-batch ends the accumulation: DeepSpeed then
            # reduces the gradients and `step` updates the weights; before it, `step` does nothing.
            self.engine.set_gradient_accumulation_boundary(state.last_micro and state.backwards_left == 0)
        self._backward(t)
        if self.engine is not None:
            self.engine.step()

    @staticmethod
    def _likelihood_stats(old, blocks, noise, resp, lengths) -> dict:
        """ELBO estimates of the behaviour (old) policy: per sequence, per token, per block per token."""
        dev = old.device
        K = noise.block_size
        L = resp.shape[1]
        nb = blocks.shape[-1]
        blk = torch.arange(L) // K
        toks = torch.zeros(resp.shape[0], nb).index_add_(1, blk, resp.float()).to(dev)  # (B, nb)
        block_elbo = blocks.mean(1)  # (B, nb) mean over draws
        has = toks > 0
        per_tok_block = (block_elbo[has] / toks[has])
        seq = old.mean(1)
        masked = noise.masked.float().sum(-1)  # (N, B)
        return {
            "likelihood/elbo_seq_mean": float(seq.mean()),
            "likelihood/elbo_per_token_mean": float((seq / lengths.clamp(min=1)).mean()),
            "likelihood/block_per_token_mean": float(per_tok_block.mean()),
            "likelihood/block_per_token_min": float(per_tok_block.min()),
            "likelihood/block_per_token_max": float(per_tok_block.max()),
            "likelihood/blocks_per_seq": float(has.float().sum(1).mean()),
            "likelihood/masked_per_seq": float(masked.mean()),
            "likelihood/composite_std": float(old.std(1).mean()) if old.shape[1] > 1 else 0.0,
        }

    # ------------------------------------------------------------------------------------------------
    def get_model(self):
        """The policy as a plain `LLaDA2MoeModelLM` (LoRA: a merged copy; the live model is untouched)."""
        if self.cfg.lora.enabled:
            merged = copy.deepcopy(self.model).merge_and_unload()
            return merged
        return self.model

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Full policy weights as CPU tensors under the model's own names (LoRA merged in)."""
        if self.cfg.lora.enabled:
            return {k: v.detach().cpu().clone() for k, v in self.get_model().state_dict().items()}
        if self.engine is not None and self.cfg.zero_stage == 3:  # gathered 256 MiB at a time, on every rank
            return {k: v for part in WeightStreamer(self.model, True, 1 << 28).cpu_buckets() for k, v in part.items()}
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def _extra_state(self) -> dict:
        return {"generator": self.generator.get_state(), "updates_done": self.updates_done,
                "lr_now": self.lr_now, "config": asdict(self.cfg)}

    def save(self, path: str) -> None:
        """Write model, optimizer, schedule position and RNG state under `path/`."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        if self.engine is not None:  # every rank writes its own shard
            self.engine.save_checkpoint(str(out / "deepspeed"), tag="state")
        elif self.rank == 0:  # torch backend: the ranks hold identical weights and optimizer states
            torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                       out / "learner_state.pt")
        if self.rank == 0:
            torch.save(self._extra_state(), out / "learner_meta.pt")
            if self.snapshots.keep > 0:  # the behaviour policies of the batches still in flight
                torch.save(self.snapshots.state(), out / "behaviour_snapshots.pt")
        if self.world_size > 1:
            torch.distributed.barrier()  # the checkpoint is complete on return from every rank

    def load(self, path: str) -> None:
        """Restore what `save` wrote (same config and backend)."""
        src = Path(path)
        if not (src / "learner_meta.pt").exists():
            raise FileNotFoundError(f"{src}: no learner_meta.pt; not a learner checkpoint")
        if self.engine is not None:
            self.engine.load_checkpoint(str(src / "deepspeed"), tag="state")
        else:
            state = torch.load(src / "learner_state.pt", map_location=self.device, weights_only=False)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        meta = torch.load(src / "learner_meta.pt", weights_only=False)
        self.generator.set_state(meta["generator"])
        if (src / "behaviour_snapshots.pt").exists():
            self.snapshots.restore(torch.load(src / "behaviour_snapshots.pt", weights_only=False))
        self.updates_done = meta["updates_done"]
        self.lr_now = meta["lr_now"]
