"""Teacher-forced probe of the one-digit facts in the worked math task.

For each held-out row, the reference working is given up to every `=` and the model predicts the next
position (masked, with the rest of its block masked too, as in decoding): is the first digit of the
column result right? This separates "the model does not know 7*9" from "parallel decoding lost it".

    python examples/tasks/probe_facts.py --model tiny-sft --rows 120
    -> facts 240: argmax accuracy 0.988, mean p(right digit) 0.960
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


@torch.no_grad()
def probe_facts(model, tokenizer, rows: list[dict]) -> tuple[float, float, int]:
    """(argmax accuracy, mean probability of the right digit, number of results probed) over every
    digit that follows an `=` in the rows' reference responses. One forward per result: the prompt and
    the reference response up to that position are visible, that position and the rest of its block
    of K tokens are masks (block-causal attention, so later blocks do not matter and are left out)."""
    from ebpo.data import encode_prompt

    K, mask_id = model.config.block_size, model.config.mask_token_id
    hits, probs = [], []
    for row in rows:
        prompt = encode_prompt(tokenizer, row["prompt"], True)
        text = row["response"]
        ids = prompt + tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != len(prompt) + len(text):
            raise ValueError("probe_facts needs a character-level tokenizer (one token per response character)")
        for j in range(1, len(text)):
            if text[j - 1] != "=":
                continue
            i = len(prompt) + j
            end = (i // K + 1) * K
            x = (ids + [mask_id] * end)[:end]
            x[i:end] = [mask_id] * (end - i)
            p = model(torch.tensor([x])).logits[0, i].float().softmax(-1)
            hits.append(float(int(p.argmax()) == ids[i]))
            probs.append(float(p[ids[i]]))
    n = len(hits)
    return sum(hits) / max(n, 1), sum(probs) / max(n, 1), n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-sft", help="folder, tiny-sft or preset:NAME")
    ap.add_argument("--data", default=str(ROOT / "examples/data/math_eval.jsonl"))
    ap.add_argument("--rows", type=int, default=120, help="first N rows of --data")
    args = ap.parse_args(argv)
    from ebpo.model.loading import load_model, load_model_tokenizer

    model = load_model(args.model).eval()
    tokenizer = load_model_tokenizer(args.model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()[: args.rows]]
    acc, mean_p, n = probe_facts(model, tokenizer, rows)
    print(f"facts {n}: argmax accuracy {acc:.3f}, mean p(right digit) {mean_p:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
