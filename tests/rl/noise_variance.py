"""Measure the spread of the two noise forms (`learner.noise: bernoulli | exact_elbo`) on quickstart data.

    python tests/rl/noise_variance.py [--prompts 16 --group 4 --reps 24 --block-size 0 --json OUT]

Rollouts of the quickstart model (tiny-sft-mixed, Q Mode, temperature 1, 40 new tokens) on training
prompts; "old" = that model, "new" = the model after one quickstart learner update (lr 5e-5, the math
reward's advantages). For each form and N in {1, 2, 8}, `reps` independent sets of N draws per sequence
give the spread (std over reps, averaged over sequences) of
  * the ELBO estimate (1/N) sum_n C_n of the old policy, and
  * the log-ratio estimate (1/N) sum_n (C_n^new - C_n^old), the quantity the clip acts on.
Not a test (no `test_` prefix): a measurement documented in docs/ebpo.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--reps", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=0, help="0 = the model's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from rewards.math_reward import math_reward
    from rollout import DecodeConfig, generate

    from ebpo.core.algos import compute_advantages
    from ebpo.core.likelihood import all_composites, draw_noise
    from ebpo.infra.data import encode_prompt, load_rows
    from ebpo.model.loading import load_model, load_model_tokenizer
    from ebpo.rl.records import build_learner_batch
    from ebpo.rl.learner import EBPOLearner, LearnerConfig

    t0 = time.time()
    model = load_model("tiny-sft-mixed").eval()
    tok = load_model_tokenizer("tiny-sft-mixed")
    K = args.block_size or model.config.block_size
    rows = load_rows("examples/data/math_train.jsonl")[: args.prompts]
    prompts = [encode_prompt(tok, r["prompt"]) for r in rows for _ in range(args.group)]
    cfg = DecodeConfig.preset("quality", temperature=1.0, max_new_tokens=40, block_size=K)
    with torch.no_grad():
        outs = generate(model, prompts, cfg, tokenizer=tok, seeds=list(range(len(prompts))))
    scores = torch.tensor([float(math_reward(completion=o.text, answer=rows[i // args.group]["answer"]).score or 0.0)
                           for i, o in enumerate(outs)])
    groups = torch.arange(args.prompts).repeat_interleave(args.group)
    adv = compute_advantages(scores, groups)
    batch = build_learner_batch(prompts, [o.token_ids for o in outs], adv, groups, pad_id=tok.eos_token_id,
                                tail_ids=[o.tail_ids for o in outs])
    learner = EBPOLearner(copy.deepcopy(model), LearnerConfig(lr=5e-5, n_draws=2, block_size=K, grad_replay=False,
                                                              seed=args.seed))
    learner.update(batch)
    new = learner.get_model().eval()
    ids, resp = batch.input_ids, batch.response_mask
    B = ids.shape[0]
    out = {"sequences": B, "response_tokens_mean": float(resp.sum(1).float().mean()), "block_size": K,
           "reward_mean": float(scores.mean()), "reps": args.reps}
    for form in ("bernoulli", "exact_elbo"):
        for N in (1, 2, 8):
            g = torch.Generator().manual_seed(1000 + N)
            elbo, lr = [], []
            for _ in range(args.reps):
                nz = draw_noise(resp, K, N, 0.1, 1.0, g, form=form)
                with torch.no_grad():
                    c_old = all_composites(model, ids, nz, model.config.mask_token_id, cached=True).double()
                    c_new = all_composites(new, ids, nz, new.config.mask_token_id, cached=True).double()
                elbo.append(c_old.mean(1))
                lr.append((c_new - c_old).mean(1))
            elbo, lr = torch.stack(elbo), torch.stack(lr)  # (reps, B)
            out[f"{form}/N{N}/elbo_std"] = float(elbo.std(0).mean())
            out[f"{form}/N{N}/log_ratio_std"] = float(lr.std(0).mean())
            out[f"{form}/N{N}/elbo_mean"] = float(elbo.mean())
            out[f"{form}/N{N}/log_ratio_mean"] = float(lr.mean())
            out[f"{form}/N{N}/log_ratio_abs_mean"] = float(lr.mean(0).abs().mean())
    for N in (1, 2, 8):
        for what in ("elbo_std", "log_ratio_std"):
            out[f"ratio_bernoulli_over_exact/N{N}/{what}"] = out[f"bernoulli/N{N}/{what}"] / out[f"exact_elbo/N{N}/{what}"]
    out["seconds"] = time.time() - t0
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
