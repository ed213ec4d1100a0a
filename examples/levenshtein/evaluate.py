"""Held-out comparison of Levenshtein editing against T2T-only decoding (docs/rl.md, "Levenshtein editing").

    python examples/levenshtein/evaluate.py MODEL [MODEL ...] [--rows 200] [--out docs/bench/levenshtein_cpu.json]

Each model decodes the held-out arithmetic rows (examples/data/math_eval.jsonl) greedily with the `quality`
preset (max_new_tokens 40), once with T2T editing only and, when its config names the edit-control tokens,
once more with DELETE / INSERT on (tau_delete = tau_insert = 0.5, at most 2 per block and round). Prints a
markdown table: accuracy, TPF, edits per sequence (T2T + DELETE + INSERT), deletes and inserts per sequence.

Then a repair test on the same rows: each correct response (prompt + response + EOS, in blocks of 8) gets
length errors in every block (`ebpo.core.lev_objective.corrupt_blocks` with lev_rate 1: an inserted, dropped or
duplicated token, a second one with probability 1, then partial masking; seed 0), and the model edits it for
up to 4 rounds (one `[draft ; clean]` forward per round, so block b sees the correct blocks before it; argmax,
[MASK] excluded; its DELETE / INSERT predictions applied as in `apply_ops`). Reported: the fraction of rows
whose response is exactly repaired after 1 and 4 rounds.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ebpo.infra.data import load_rows
from ebpo.model.loading import load_model, load_model_tokenizer
from ebpo.infra.data import encode_prompt
from ebpo.sft.evaluation import score_rows
from rollout import DecodeConfig, generate

LEV = dict(tau_delete=0.5, tau_insert=0.5, max_lev_edits=2)


@torch.no_grad()
def edit_round(model, draft: torch.Tensor, ids: torch.Tensor, resp: torch.Tensor, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One round of the model's edits on `draft` (B, L): (next draft (B, L), predicted ids (B, L)).

    One `[draft ; clean]` forward (block b sees the correct blocks before it), argmax with [MASK] excluded, and
    its DELETE / INSERT predictions applied as in `apply_ops`; positions outside `resp` stay as they are.
    """
    from ebpo.core.lev_objective import apply_predictions
    from ebpo.core.objectives import noisy_half_hidden

    cfg = model.config
    mask = cfg.mask_token_id
    dele = cfg.delete_token_id if cfg.delete_token_id is not None else -1
    ins = cfg.insert_token_id if cfg.insert_token_id is not None else -1
    logits = model.lm_head(noisy_half_hidden(model, draft, ids, block_size)).float()
    logits[..., mask] = float("-inf")
    pred = logits.argmax(-1)
    return apply_predictions(draft, pred, block_size, mask, dele, ins, resp), pred


@torch.no_grad()
def repair(model_path: str, rows: list[dict], rounds: int = 4, block_size: int | None = None) -> dict:
    """Repair test (module docstring) in blocks of `block_size` (None = the model's own)."""
    from ebpo.core.lev_objective import corrupt_blocks
    from ebpo.infra.data import collate, encode_sft
    from ebpo.core.noise import substitution_ids

    model = load_model(model_path).eval()
    tok = load_model_tokenizer(model_path)
    cfg = model.config
    K, mask = block_size or cfg.block_size, cfg.mask_token_id
    ids, resp = collate([encode_sft(tok, r["prompt"], r["response"], chat_template=True, max_len=128) for r in rows],
                        K, tok.pad_token_id, eos_id=tok.eos_token_id, mask_id=mask)
    allowed = substitution_ids(cfg.vocab_size, sorted(set(tok.all_special_ids) - {tok.eos_token_id} | {mask}))
    draft = corrupt_blocks(ids, resp, K, mask, 1.0, allowed, torch.Generator().manual_seed(0))
    corrupted = float((~(draft.eq(ids) | ~resp).all(-1)).float().mean())
    fixed = []
    for _ in range(rounds):
        draft = edit_round(model, draft, ids, resp, K)[0]
        fixed.append(float((draft.eq(ids) | ~resp).all(-1).float().mean()))
    return {"model": model_path, "repaired_after_1": fixed[0], f"repaired_after_{rounds}": fixed[-1],
            "corrupted": corrupted}


def decode_rows(model, tok, rows: list[dict], cfg: DecodeConfig, batch_size: int = 100, **kw) -> list:
    """`generate` over the rows' prompts (chat template) in batches; one `GenerationOutput` per row."""
    prompts = [encode_prompt(tok, r["prompt"], True) for r in rows]
    outs = []
    with torch.no_grad():
        for s in range(0, len(prompts), batch_size):
            extra = {k: v[s:s + batch_size] for k, v in kw.items()}  # per-row lists (seeds)
            outs += generate(model, prompts[s:s + batch_size], cfg, tokenizer=tok, **extra)
    return outs


def evaluate(model_path: str, rows: list[dict], lev: bool, batch_size: int = 100) -> dict:
    model = load_model(model_path).eval()
    tok = load_model_tokenizer(model_path)
    cfg = DecodeConfig.preset("quality", max_new_tokens=40, **(LEV if lev else {}))
    t0 = time.perf_counter()
    outs = decode_rows(model, tok, rows, cfg, batch_size)
    correct = score_rows(rows, [o.text for o in outs])
    n = len(rows)
    return {"model": model_path, "decode": "levenshtein" if lev else "t2t", "rows": n,
            "accuracy": sum(correct) / n, "tpf": sum(len(o.token_ids) for o in outs) / sum(o.num_forwards for o in outs),
            "edits_per_seq": sum(o.num_edits for o in outs) / n, "deletes_per_seq": sum(o.num_deletes for o in outs) / n,
            "inserts_per_seq": sum(o.num_inserts for o in outs) / n, "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--data", default="examples/data/math_eval.jsonl")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = load_rows(args.data)[: args.rows]
    results = []
    for m in args.models:
        has_ids = getattr(load_model(m).config, "delete_token_id", None) is not None
        for lev in ([False, True] if has_ids else [False]):
            results.append(evaluate(m, rows, lev))
            print(json.dumps(results[-1]), flush=True)
    print("\n| model | decoding | accuracy | TPF | edits / seq | deletes / seq | inserts / seq |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['decode']} | {r['accuracy']:.3f} | {r['tpf']:.2f} | {r['edits_per_seq']:.2f} | "
              f"{r['deletes_per_seq']:.2f} | {r['inserts_per_seq']:.2f} |")
    fixes = [repair(m, rows) for m in args.models]
    print("\n| model | rows with length errors | repaired after 1 round | after 4 rounds |")
    print("|---|---|---|---|")
    for r in fixes:
        print(f"| {r['model']} | {r['corrupted']:.2f} | {r['repaired_after_1']:.2f} | {r['repaired_after_4']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"decode": results, "repair": fixes}, indent=1) + "\n")


if __name__ == "__main__":
    main()
