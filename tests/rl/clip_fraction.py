"""Clip fraction of the real-scale recipe shapes on the tiny model: off-policy minibatches vs one on-policy step.

    python tests/rl/clip_fraction.py [--prompts 16 --group 8 --max-new 40 --lr 5e-5 --json OUT]

One batch of quickstart rollouts (tiny-sft-mixed, Q Mode, temperature 1, math reward + GRPO advantages),
then one learner update per setting, each from the same weights and with the same seed:
  * `minibatch_size = B/4, mu = 1`, no length normalisation (the LLaDA2.1-mini recipes before this change:
    four optimizer steps per batch, the last three off-policy);
  * the same with `length_normalize: true`;
  * `minibatch_size = 0, mu = 1` (one on-policy step: what the recipes do now).
Reported: the learner's clip fractions (means over the update's optimizer steps), and, on the same noise
draws, the sequence-level log-ratio between the updated and the initial model by response-length half
(how far long and short sequences moved, and the share outside the clip window).
Not a test (no `test_` prefix): a measurement documented in docs/ebpo.md.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--n-draws", type=int, default=2)
    ap.add_argument("--noise", default="bernoulli")
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
    rows = load_rows("examples/data/math_train.jsonl")[: args.prompts]
    prompts = [encode_prompt(tok, r["prompt"]) for r in rows for _ in range(args.group)]
    with torch.no_grad():
        outs = generate(model, prompts, DecodeConfig.preset("quality", temperature=1.0, max_new_tokens=args.max_new),
                        tokenizer=tok, seeds=list(range(len(prompts))))
    scores = torch.tensor([float(math_reward(completion=o.text, answer=rows[i // args.group]["answer"]).score or 0.0)
                           for i, o in enumerate(outs)])
    groups = torch.arange(args.prompts).repeat_interleave(args.group)
    adv = compute_advantages(scores, groups)
    batch = build_learner_batch(prompts, [o.token_ids for o in outs], adv, groups, pad_id=tok.eos_token_id,
                                tail_ids=[o.tail_ids for o in outs])
    B = len(prompts)
    lengths = batch.response_mask.sum(1).float()
    long = lengths >= lengths.median()
    nz = draw_noise(batch.response_mask, model.config.block_size, 16, 0.1, 1.0, torch.Generator().manual_seed(7),
                    form=args.noise)
    with torch.no_grad():
        c_old = all_composites(model, batch.input_ids, nz, model.config.mask_token_id, cached=True).double()
    out = {"sequences": B, "response_tokens_mean": float(lengths.mean()), "reward_mean": float(scores.mean()),
           "lr": args.lr, "n_draws": args.n_draws, "noise": args.noise}
    settings = {"4_minibatches": dict(minibatch_size=B // 4),
                "4_minibatches_length_normalized": dict(minibatch_size=B // 4, length_normalize=True),
                "on_policy_single_step": dict(minibatch_size=0)}
    for name, kw in settings.items():
        cfg = LearnerConfig(lr=args.lr, n_draws=args.n_draws, mu=1, seed=0, noise=args.noise, **kw)
        learner = EBPOLearner(copy.deepcopy(model), cfg)
        m = learner.update(batch)
        new = learner.get_model().eval()
        with torch.no_grad():
            c_new = all_composites(new, batch.input_ids, nz, model.config.mask_token_id, cached=True).double()
        lr_seq = (c_new - c_old).mean(1)
        norm = lr_seq / lengths if kw.get("length_normalize") else lr_seq
        outside = (norm > math.log1p(cfg.eps_high)) | (norm < math.log1p(-cfg.eps_low))
        res = {k.split("/")[1]: m[k] for k in ("actor/clipfrac_low", "actor/clipfrac_high", "actor/clipfrac_dual",
                                                "actor/log_ratio_max", "actor/grad_norm")}
        res["clipfrac_total"] = res["clipfrac_low"] + res["clipfrac_high"] + res["clipfrac_dual"]
        for part, sel in (("long_half", long), ("short_half", ~long)):
            res[f"after_update/{part}/abs_log_ratio_mean"] = float(norm[sel].abs().mean())
            res[f"after_update/{part}/outside_clip_window"] = float(outside[sel].double().mean())
        out[name] = res
    out["seconds"] = time.time() - t0
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
