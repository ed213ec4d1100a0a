"""CPT/SFT trainer: `ebpo train recipes/sft_*.yaml` / `recipes/cpt_*.yaml` (kind sft or cpt).

One optimizer step, as data:
    rows -> token examples (chat template + response + EOS for SFT, packed documents for CPT)
      -> collate (right-pad to whole blocks; response mask)
      -> noise (stratified t, M2T masks, T2T substitutions)            ebpo.core.noise
      -> [noisy ; clean] forward, mixture loss (+ MTF second pass)     ebpo.core.objectives
      -> backward (x grad_accum), clip, AdamW, warmup + cosine
      -> metrics (JSONL + W&B), periodic held-out eval, checkpoints    ebpo.infra.tracking / evaluation / checkpoint
"""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch

from ebpo.model import enable_activation_checkpointing
from ebpo.infra.checkpoint import latest_checkpoint, load_latest, load_training_state, save_checkpoint
from ebpo.infra.config import ConfigError, load_config, to_dict
from ebpo.infra.data import EpochSampler, collate, encode_sft, load_rows, pack_documents
from ebpo.infra.distributed import init_distributed
from ebpo.infra.run_config import open_run_dir
from ebpo.core.noise import make_noisy, substitution_ids
from ebpo.core.schedule import lr_schedule
from ebpo.core.objectives import LossShard, mixture_loss, shard_of, take_rows
from ebpo.sft.config import SFTConfig


def name_edit_tokens(model_config, tokenizer):
    """Set `delete_token_id` / `insert_token_id` of a character-tokenizer model trained before they were named;
    returns the tokenizer that names them (the project's, whose ids below them are `tokenizer`'s, checked)."""
    from ebpo.model.tokenizer import DELETE, INSERT, load_tokenizer

    named = load_tokenizer()
    ids = named.convert_tokens_to_ids([DELETE, INSERT])
    if {t: i for t, i in named.get_vocab().items() if i < min(ids)} != tokenizer.get_vocab():
        raise ValueError("edit_tokens: the model's tokenizer is not the project's character tokenizer; set "
                         "delete_token_id / insert_token_id in its config.json yourself")
    model_config.delete_token_id, model_config.insert_token_id = ids
    model_config.validate()
    return named


def build_examples(cfg: SFTConfig, tokenizer, rows: list[dict], block_size: int = 0) -> list[tuple[list[int], int]]:
    """(ids, prompt_len) per training example: SFT rows, or CPT chunks (prompt_len 0: all is response); a
    multi-turn row (with `data.messages_field`) gives (ids, loss mask) laid out for blocks of `block_size`."""
    d = cfg.data
    if cfg.kind == "cpt":
        return [(c, 0) for c in pack_documents(tokenizer, [r[d.text_field] for r in rows], d.max_len)]
    out = []
    for r in rows:
        if d.multi_turn:  # multi-turn chat with tool calls (ebpo/sft/multiturn.py)
            from ebpo.sft.multiturn import encode_messages

            out.append(encode_messages(tokenizer, r[d.messages_field], block_size, max_len=d.max_len))
        else:
            out.append(encode_sft(tokenizer, r[d.prompt_field], r[d.response_field], chat_template=d.chat_template,
                                  max_len=d.max_len, max_prompt_tokens=d.max_prompt_tokens))
    return out


class SFTTrainer:
    def __init__(self, cfg: SFTConfig):
        from ebpo.model.loading import load_model, load_model_tokenizer
        from ebpo.infra.tracking import Tracker

        self.cfg = cfg
        tc = cfg.trainer
        if tc.num_threads:
            torch.set_num_threads(tc.num_threads)
        self.resume_dir = Path(tc.resume) if tc.resume else None
        self.run_dir = self.resume_dir or Path(tc.run_dir or f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        if self.resume_dir and latest_checkpoint(self.run_dir) is None:
            raise ConfigError(f"trainer.resume: no checkpoint in {self.run_dir}/checkpoints")
        # rank 0 records the configuration (on resume: checks and logs the changes); the others only check
        open_run_dir(self.run_dir, to_dict(cfg), resume=self.resume_dir is not None, allowed=tc.resume_changes,
                     write=int(os.environ.get("RANK", "0")) == 0)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

        self.tokenizer = load_model_tokenizer(cfg.model)
        required = (cfg.data.text_field,) if cfg.kind == "cpt" else (cfg.data.prompt_field, cfg.data.response_field)
        train_rows = load_rows(cfg.data.train, (cfg.data.messages_field,) if cfg.data.multi_turn else required)
        self.eval_rows = load_rows(cfg.data.eval) if cfg.data.eval else []
        if cfg.eval.size and self.eval_rows:
            from ebpo.sft.evaluation import balanced_subset

            self.eval_rows = balanced_subset(self.eval_rows, cfg.eval.size)  # every task represented
        self.noise_gen = torch.Generator().manual_seed(tc.seed)
        self.pending: list[list[int]] = []  # bucketed batches not served yet (saved in checkpoints)

        dtype = torch.bfloat16 if tc.dtype == "bfloat16" else torch.float32
        spec = cfg.model
        if spec.startswith("preset:") and "@" not in spec:
            spec = f"{spec}@{tc.seed}"  # random init seeded by trainer.seed
        base = load_model(spec, dtype=dtype, device=self.device)
        self.model_config = base.config
        self.block_size = cfg.block_size or base.config.block_size
        base.config.block_size = self.block_size  # the exported model says which blocks it was trained on
        self.mask_id = base.config.mask_token_id
        if cfg.edit_tokens and getattr(base.config, "delete_token_id", None) is None:
            self.tokenizer = name_edit_tokens(base.config, self.tokenizer)
        if cfg.objective.lev_weight > 0 and getattr(base.config, "delete_token_id", None) is None:
            raise ValueError("objective.lev_weight: the model's config has no delete_token_id / insert_token_id "
                             "(start from preset:tiny, whose vocabulary names them)")
        self.lev_next_draft = None  # None: the Levenshtein rounds' next drafts are the argmax (lev_draft.preset null)
        lev_decode = cfg.lev_draft.decode_config()
        if cfg.objective.lev_weight > 0 and lev_decode is not None:
            from ebpo.sft.lev_draft import decoder_next_draft

            self.lev_next_draft = decoder_next_draft(lev_decode, self.mask_id, base.config.delete_token_id,
                                                     base.config.insert_token_id)
        exclude = set(self.tokenizer.all_special_ids) - {self.tokenizer.eos_token_id} | {self.mask_id}
        # the edit-control tokens (ids that were unused before issue 29) stay allowed substitutes, so the T2T
        # noise of a run is what it was before they were named
        exclude -= {getattr(base.config, "delete_token_id", None), getattr(base.config, "insert_token_id", None)}
        self.allowed_ids = substitution_ids(base.config.vocab_size, sorted(exclude))
        self.examples = build_examples(cfg, self.tokenizer, train_rows, self.block_size)
        self.sampler = EpochSampler(len(self.examples), tc.seed, cfg.data.shuffle)
        if tc.gradient_checkpointing:
            enable_activation_checkpointing(base)
        self.base = base
        self.model = self._wrap_lora(base) if cfg.lora.enabled else base
        self.model.train()
        self.lm_head = base.get_output_embeddings()
        params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_schedule(s, 1.0, o.warmup_steps, tc.steps, "cosine", o.min_lr_ratio))
        self.engine = None
        if tc.backend == "deepspeed":
            self._init_deepspeed()
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        # Every rank draws the noise of the whole global batch from the same generator and keeps its own rows,
        # so that W ranks compute the update of one rank on the global batch (`train_step`).
        self.start_step, run_id = 0, None
        if self.resume_dir:
            run_id = self._restore()
        self.tracker = Tracker(self.run_dir if self.rank == 0 else self.run_dir / f"rank{self.rank}", to_dict(cfg),
                               project=tc.wandb_project, mode=tc.tracking if self.rank == 0 else "none",
                               run_id=run_id, name=cfg.name)
        self.n_params = sum(p.numel() for p in base.parameters())

    # ----------------------------------------------------------------------------------------- setup
    def _wrap_lora(self, base):
        from peft import get_peft_model

        return get_peft_model(base, self.cfg.lora.peft_config())

    def _init_deepspeed(self) -> None:
        import deepspeed

        init_distributed()
        tc, o = self.cfg.trainer, self.cfg.optim
        ds_config = {
            "train_micro_batch_size_per_gpu": tc.batch_size,
            "gradient_accumulation_steps": o.grad_accum,
            "gradient_clipping": o.grad_clip,
            "zero_optimization": {"stage": tc.zero_stage},
            "bf16": {"enabled": tc.dtype == "bfloat16"},
            "steps_per_print": 10 ** 9,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.model, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=ds_config)

    def _restore(self) -> str | None:
        step, path, state = load_latest(self.run_dir)
        if self.engine is not None:
            self.engine.load_checkpoint(str(path / "deepspeed"), tag="state")
        else:
            self._load_weights(path)
            load_training_state(path, self.optimizer, self.scheduler)
        load_training_state(path, None, None, {"noise": self.noise_gen})  # RNG, and the noise generator
        self.sampler.restore(state["sampler"])
        by_rank = state.get("pending_by_rank", [state.get("pending", [])])
        if len(by_rank) != self.world:
            raise ValueError(f"trainer.resume: the checkpoint was written by {len(by_rank)} ranks, this run has "
                             f"{self.world}; resume with the same number of ranks")
        self.pending = [list(g) for g in by_rank[self.rank]]
        self.start_step = step
        return state.get("wandb_run_id")

    def _load_weights(self, path: Path) -> None:
        if (path / "weights.pt").exists():  # LoRA: the adapter (and the frozen base it sits on)
            self.model.load_state_dict(torch.load(path / "weights.pt", weights_only=True))
        else:
            from ebpo.model.loading import load_model

            self.base.load_state_dict(load_model(str(path / "model"), dtype=next(self.base.parameters()).dtype).state_dict())

    # ----------------------------------------------------------------------------------------- steps
    def micro_batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Next n training examples as (input_ids (n, L), response_mask (n, L)).

        Length bucketing: `data.bucket` batches' worth of indices are drawn, sorted by length, cut into
        batches and served in a seeded random order, so short examples are not padded to long ones.
        """
        if not self.pending:
            k, w = max(1, self.cfg.data.bucket), self.world
            idx = sorted(self.sampler.take(n * k * w), key=lambda i: len(self.examples[i][0]))
            # every rank holds the same global batches (n * w examples); `train_step` gives rank r rows r::w
            groups = [idx[j:j + n * w] for j in range(0, len(idx), n * w)]
            random.Random(self.cfg.trainer.seed * 7919 + self.sampler.epoch * 104729 + self.sampler.pos).shuffle(groups)
            self.pending = groups
        idx = self.pending.pop()
        ids, resp = collate([self.examples[i] for i in idx], self.block_size, self.tokenizer.pad_token_id,
                            eos_id=self.tokenizer.eos_token_id, mask_id=self.mask_id)
        return ids.to(self.device), resp.to(self.device)

    def loss_on(self, clean: torch.Tensor, response: torch.Tensor, generator: torch.Generator,
                shard_rows: torch.Tensor | None = None):
        """Mixture loss of a batch; with `shard_rows` ((b,) long), this rank's rows of a global batch whose
        noise is drawn whole (same on every rank) and whose terms are normalised by the whole batch's counts."""
        ob = self.cfg.objective
        nb = make_noisy(clean.cpu(), response.cpu(), mask_id=self.mask_id, t_min=ob.t_min, t_max=ob.t_max,
                        t2t_rate=ob.t2t_rate if ob.t2t_weight > 0 else 0.0, allowed_ids=self.allowed_ids,
                        generator=generator, min_one=ob.min_one_mask)
        shard = None
        if shard_rows is not None:
            shard = shard_of(response.cpu(), nb, shard_rows, ob.mtf_fraction)
            shard = LossShard(shard.counts, shard.mtf_rows.to(self.device))
            nb = take_rows(nb, shard_rows)
            rows = shard_rows.to(clean.device)
            clean, response = clean[rows], response[rows]
        if self.device.type != "cpu":
            nb = type(nb)(**{k: v.to(self.device) for k, v in vars(nb).items()})
        fwd = self.engine if self.engine is not None else self.model
        loss, metrics, draft = mixture_loss(fwd, self.lm_head, clean, response, nb, ob, self.block_size, self.mask_id,
                                            shard=shard)
        if ob.mbe_weight > 0:  # the Multi-Block Editing window pattern (ebpo/core/mbe_objective.py)
            from ebpo.core.mbe_objective import mbe_window_loss

            if shard is not None:  # its per-token means are per rank, not normalised by the global batch
                raise ValueError("objective.mbe_weight: the MBE window term runs on one rank only (trainer world "
                                 f"size {self.world}); set objective.mbe_weight=0 or train on one rank")
            mbe, m = mbe_window_loss(fwd, self.lm_head, clean, response, block_size=self.block_size,
                                     window=ob.mbe_window, rate=ob.t2t_rate, keep_weight=ob.keep_weight,
                                     allowed_ids=self.allowed_ids, generator=generator)
            loss = loss + ob.mbe_weight * mbe
            metrics.update(m, **{"loss/total": float(loss.detach())})
        if ob.lev_weight > 0:  # Levenshtein rounds on the first round's draft (ebpo/core/lev_objective.py)
            from ebpo.core.lev_objective import levenshtein_loss

            if shard is not None:
                raise ValueError("objective.lev_weight: the Levenshtein rounds run on one rank only; set "
                                 "objective.lev_weight=0 or train on one rank")
            mc = self.model_config
            lev, m = levenshtein_loss(fwd, self.lm_head, clean, response, draft, ob, self.block_size, self.mask_id,
                                      mc.delete_token_id, mc.insert_token_id, self.allowed_ids, generator,
                                      next_draft=self.lev_next_draft)
            loss = loss + ob.lev_weight * lev
            metrics.update(m, **{"loss/total": float(loss.detach())})
        return loss, metrics, draft

    def train_step(self) -> dict:
        tc, o = self.cfg.trainer, self.cfg.optim
        totals: dict[str, float] = {}
        n_tokens = 0
        for _ in range(o.grad_accum):
            clean, response = self.micro_batch(tc.batch_size)
            if self.world > 1:
                rows = torch.arange(self.rank, clean.shape[0], self.world)
                loss, metrics, _ = self.loss_on(clean, response, self.noise_gen, shard_rows=rows)
                metrics = self._sum_over_ranks(metrics)
                # each rank's loss is its part of the global batch's; DeepSpeed averages gradients over ranks
                loss = loss * self.world
                clean = clean[rows.to(clean.device)]
            else:
                loss, metrics, _ = self.loss_on(clean, response, self.noise_gen)
            if self.engine is not None:
                self.engine.backward(loss)
                self.engine.step()
            else:
                (loss / o.grad_accum).backward()
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v / o.grad_accum
            n_tokens += int(clean.numel()) * 2
        if self.engine is not None:
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        else:
            params = [p for p in self.model.parameters() if p.requires_grad]
            clip = o.grad_clip if o.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        totals["train/grad_norm"] = grad_norm
        totals["train/lr"] = self.optimizer.param_groups[0]["lr"]
        totals["train/tokens"] = float(n_tokens)
        return totals

    def _sum_over_ranks(self, metrics: dict) -> dict:
        """Metrics of the global batch from every rank's share (each is already divided by global counts)."""
        import torch.distributed as dist

        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    @torch.no_grad()
    def eval_loss(self) -> dict:
        """Mixture loss on held-out rows with a fixed noise seed (comparable across steps)."""
        n = self.cfg.eval.loss_rows
        if not n or not self.eval_rows or self.cfg.kind == "cpt":
            return {}
        rows = [r for r in self.eval_rows if self.cfg.data.response_field in r][:n]
        if not rows:
            return {}
        self.model.eval()
        gen = torch.Generator().manual_seed(12345)
        ex = build_examples(self.cfg, self.tokenizer, rows, self.block_size)
        total, count = {}, 0
        for s in range(0, len(ex), self.cfg.trainer.batch_size):
            ids, resp = collate(ex[s:s + self.cfg.trainer.batch_size], self.block_size, self.tokenizer.pad_token_id,
                                eos_id=self.tokenizer.eos_token_id, mask_id=self.mask_id)
            _, m, _ = self.loss_on(ids.to(self.device), resp.to(self.device), gen)
            for k in ("loss/total", "loss/m2t", "acc/m2t"):
                if k in m:
                    total[k] = total.get(k, 0.0) + m[k]
            count += 1
        self.model.train()
        return {f"eval/{k.replace('/', '_')}": v / count for k, v in total.items()}

    def evaluate(self) -> dict:
        """Held-out loss, and accuracy/TPF per decode preset with the project's decoder."""
        metrics = self.eval_loss()
        if not self.eval_rows or not self.cfg.eval.presets or self.cfg.kind == "cpt":
            return metrics
        try:
            from ebpo.sft.evaluation import evaluate_rows
        except ImportError as e:  # the decoder package is optional for training
            print(f"[sft] held-out decoding skipped: {e}")
            return metrics
        self.model.eval()
        try:
            for preset in self.cfg.eval.presets:
                res = evaluate_rows(self.base, self.tokenizer, self.eval_rows, preset=preset,
                                    decode=self.cfg.eval.decode, batch_size=self.cfg.eval.batch_size,
                                    chat_template=self.cfg.data.chat_template,
                                    prompt_field=self.cfg.data.prompt_field)
                metrics.update(res.metrics(prefix=f"eval/{preset}/"))
        finally:
            self.model.train()
        return metrics

    def save(self, step: int) -> Path:
        tc = self.cfg.trainer
        pending = [self.pending]
        if self.world > 1:  # each rank holds its own slice of the bucketed batches: keep them all
            import torch.distributed as dist

            pending = [None] * self.world
            dist.all_gather_object(pending, self.pending)
        state = {"sampler": self.sampler.state(), "pending_by_rank": pending, "wandb_run_id": self.tracker.run_id}
        if self.engine is not None:
            return save_checkpoint(self.run_dir, step, self.export_model(), extra_state=state, keep_last=tc.keep_last,
                                   tokenizer=self.tokenizer, generators={"noise": self.noise_gen},
                                   save_fn=lambda d: self.engine.save_checkpoint(str(d / "deepspeed"), tag="state"))
        extra = None
        if self.cfg.lora.enabled:
            extra = lambda d: torch.save(self.model.state_dict(), d / "weights.pt")  # noqa: E731
        return save_checkpoint(self.run_dir, step, self.export_model(), self.optimizer, self.scheduler,
                               extra_state=state, keep_last=tc.keep_last, tokenizer=self.tokenizer,
                               generators={"noise": self.noise_gen}, save_fn=extra)

    def export_model(self):
        """A plain `LLaDA2MoeModelLM` with the trained weights (LoRA merged into a copy)."""
        if not self.cfg.lora.enabled:
            return self.base
        import copy

        return copy.deepcopy(self.model).merge_and_unload()

    def export(self, folder: str | Path) -> Path:
        """save_pretrained (in trainer.export_dtype) + tokenizer into `folder`."""
        folder = Path(folder)
        model = self.export_model()
        if self.cfg.trainer.export_dtype == "bfloat16":
            import copy

            model = copy.deepcopy(model).to(torch.bfloat16)
        model.save_pretrained(str(folder))
        self.tokenizer.save_pretrained(str(folder))
        return folder

    # ----------------------------------------------------------------------------------------- loop
    def fit(self) -> list[dict]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        tc, ev = self.cfg.trainer, self.cfg.eval
        last = tc.steps if tc.stop_after is None else min(tc.steps, tc.stop_after)
        history: list[dict] = []
        columns = [TextColumn(f"[bold]{self.cfg.kind.upper()}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn()]
        t_start = time.perf_counter()
        window: dict[str, float] = {}
        n_window = 0
        with Progress(*columns, disable=not tc.progress) as progress:
            task = progress.add_task("train", total=tc.steps, completed=self.start_step, info="")
            for step in range(self.start_step + 1, last + 1):
                t0 = time.perf_counter()
                m = self.train_step()
                m["timing_s/step"] = time.perf_counter() - t0
                for k, v in m.items():
                    window[k] = window.get(k, 0.0) + v
                n_window += 1
                metrics = {}
                if step % tc.log_every == 0 or step == last:
                    metrics = {k: v / n_window for k, v in window.items()}
                    metrics["train/tokens"] = window["train/tokens"]
                    metrics["perf/train_tokens_per_s"] = window["train/tokens"] / max(window["timing_s/step"], 1e-9)
                    metrics["timing_s/elapsed"] = time.perf_counter() - t_start
                    window, n_window = {}, 0
                if (ev.every and step % ev.every == 0) or step == tc.steps:
                    metrics.update(self.evaluate())
                if metrics:
                    self.tracker.log(metrics, step=step)
                    history.append({"step": step, **metrics})
                acc = " ".join(f"{k.split('/')[1]}/{k.split('/')[2]} {v:.2f}" for k, v in metrics.items()
                               if k.startswith("eval/") and k.endswith("/accuracy"))
                progress.update(task, advance=1, info=f"loss {m['loss/total']:.3f} {acc}")
                if (tc.save_every and step % tc.save_every == 0) or step == last:
                    self.save(step)
        if last == tc.steps and tc.export_dir:
            self.export(tc.export_dir)
        return history

    def close(self) -> None:
        if self.cfg.trainer.plots and (self.run_dir / "metrics.jsonl").exists():
            from ebpo.infra.plots import plot_run

            plot_run(self.run_dir, PLOTS)
        self.tracker.finish()


PLOTS = {
    "loss.png": ("Training loss", ["loss/total", "loss/m2t", "loss/t2t_restore", "loss/t2t_keep", "loss/mtf",
                                   "eval/loss_total"]),
    "eval_accuracy.png": ("Held-out accuracy", None),
    "lr.png": ("Learning rate", ["train/lr"]),
}


def run(recipe: str | None, overrides: list[str]) -> Path:
    """Entry point of `ebpo train` for kinds sft and cpt: check the recipe, train, plot; returns the run dir."""
    cfg = load_config(SFTConfig, recipe, overrides)
    trainer = SFTTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    print(f"run directory: {trainer.run_dir}")
    return trainer.run_dir
