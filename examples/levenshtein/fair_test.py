"""The fair test of Levenshtein editing (issue 36; design and results: docs/levenshtein_fair_test.md).

    python examples/levenshtein/fair_test.py gate runs/fair/start --out runs/fair/start.json
    python examples/levenshtein/fair_test.py labels MODEL [MODEL ...] --start runs/fair/start.json
    python examples/levenshtein/fair_test.py table --start runs/fair/start.json NAME=MODEL [NAME=MODEL ...] \
        --out docs/bench/lev_fair_cpu.json
    python examples/levenshtein/fair_test.py curve runs/fair --out docs/bench/lev_fair_labels.png
    python examples/levenshtein/fair_test.py probe MODEL [MODEL ...] --start runs/fair/start.json

Every decode is Speedy (`speed` preset: tau_mask 0.5, tau_edit 0), greedy, 48 new tokens, DELETE / INSERT at 0.5
(at most 2 per block and round), in the model's own blocks, on the 500 held-out rows of
`examples/data/lev_fair_squeeze_eval.jsonl` (--eval), scored by exact match of the answer.

Besides exact match, every decode reports the mean edit distance of the answers to the references (also on the
start's shifted rows): a model that gets few answers exactly right can still move closer to them.

* `gate`: the start model's answers, their error kinds (`examples.tasks.lev_fair.error_kind`) and the shift share
  of its errors; written to --out (the fixed set of shifted rows that `table` reads).
* `labels`: accuracy of the DELETE / INSERT labels on held-out drafts: the start's own wrong answers laid out in
  blocks against the reference, and the references with length errors in every block (`corrupt_blocks`, rate 1,
  seed 0); one `[draft ; clean]` forward, argmax ([MASK] excluded), as in training. Also the fraction of the
  start's shifted answers one round of the model's edits turns into the reference ("own-draft repair").
* `table`: per model: accuracy, accuracy on the start's shifted rows and on the rows the start got right, the shift
  share of its own errors, TPF, DELETE / INSERT per sequence, one-round repair (`evaluate.repair`) at blocks 8, 16,
  32, the label accuracies above, and temperature-1 rollouts as the RL recipe draws them (--rollout-prompts training
  prompts, default 64, x 4):
  the share with a DELETE / INSERT operation and the share with one and a correct answer. Then the means per arm
  (NAME without its `-sN` seed suffix).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from the repository root

from ebpo.infra.data import collate, encode_sft, load_rows  # noqa: E402
from ebpo.model.loading import load_model, load_model_tokenizer  # noqa: E402
from examples.levenshtein.evaluate import decode_rows, edit_round, repair  # noqa: E402
from examples.tasks.lev_fair import edit_distance, error_kind  # noqa: E402
from rollout import DecodeConfig  # noqa: E402

EVAL, TRAIN = "examples/data/lev_fair_squeeze_eval.jsonl", "examples/data/lev_fair_squeeze_train.jsonl"
SPEEDY = dict(max_new_tokens=48, tau_delete=0.5, tau_insert=0.5, max_lev_edits=2)
# the RL recipe's rollout decoding (recipes/rl_tiny_lev_fair.yaml)
ROLLOUT = dict(temperature=1.0, max_new_tokens=48, tau_delete=0.3, tau_insert=0.3, max_lev_edits=2)
REPAIR_BLOCKS = (8, 16, 32)


def answers(model_path: str, rows: list[dict], **decode) -> tuple[list[str], list]:
    """(answer texts, GenerationOutputs) of Speedy decoding (SPEEDY unless `decode` overrides it)."""
    model, tok = load_model(model_path).eval(), load_model_tokenizer(model_path)
    seeds = decode.pop("seeds", None)
    cfg = DecodeConfig.preset("speed", **{**SPEEDY, **decode})
    outs = decode_rows(model, tok, rows, cfg, **({"seeds": seeds} if seeds else {}))
    return [o.text.strip() for o in outs], outs


def decode_metrics(model_path: str, rows: list[dict], start_kinds: list[str] | None) -> dict:
    """Held-out accuracy, error kinds, TPF, edits per sequence; accuracies on the start's shifted / right rows."""
    texts, outs = answers(model_path, rows)
    kinds = [error_kind(t, r["answer"]) for t, r in zip(texts, rows)]
    dist = [edit_distance(t, r["answer"]) for t, r in zip(texts, rows)]
    n, errors = len(rows), sum(k != "correct" for k in kinds)
    res = {"accuracy": kinds.count("correct") / n, "errors": errors, "edit_distance": sum(dist) / n,
           "shift_share": kinds.count("shift") / errors if errors else float("nan"),
           "tpf": sum(len(o.token_ids) for o in outs) / sum(o.num_forwards for o in outs),
           "deletes_per_seq": sum(o.num_deletes for o in outs) / n,
           "inserts_per_seq": sum(o.num_inserts for o in outs) / n, "kinds": kinds, "texts": texts}
    if start_kinds is not None:
        for name, want in (("shifted", "shift"), ("start_right", "correct"), ("start_subst", "substitution")):
            idx = [i for i, k in enumerate(start_kinds) if k == want]
            res[f"acc_{name}"] = sum(kinds[i] == "correct" for i in idx) / len(idx) if idx else float("nan")
            res[f"dist_{name}"] = sum(dist[i] for i in idx) / len(idx) if idx else float("nan")
            res[f"n_{name}"] = len(idx)
    return res


def own_drafts(tok, rows: list[dict], texts: list[str], block_size: int, mask_id: int):
    """(clean (B, L), draft (B, L), editable (B, L) bool): each answer text laid out after its prompt, in blocks,
    against the reference answer; editable = the response blocks of either (EOS padding after the shorter one)."""
    n = len(rows)
    enc = [encode_sft(tok, r["prompt"], r["answer"], max_len=128) for r in rows]
    enc += [encode_sft(tok, r["prompt"], t, max_len=128) for r, t in zip(rows, texts)]
    ids, resp = collate(enc, block_size, tok.pad_token_id, eos_id=tok.eos_token_id, mask_id=mask_id)
    return ids[:n], ids[n:], resp[:n] | resp[n:]


@torch.no_grad()
def label_accuracy(model_path: str, rows: list[dict], start_texts: list[str]) -> dict:
    """DELETE / INSERT label accuracy on the start's wrong answers and on corrupted references; own-draft repair."""
    from ebpo.core.lev_objective import block_labels, corrupt_blocks
    from ebpo.core.noise import substitution_ids

    model, tok = load_model(model_path).eval(), load_model_tokenizer(model_path)
    cfg = model.config
    K, mask, dele, ins = cfg.block_size, cfg.mask_token_id, cfg.delete_token_id, cfg.insert_token_id
    wrong = [i for i, (t, r) in enumerate(zip(start_texts, rows)) if t != r["answer"]]
    shifted = [i for i in wrong if error_kind(start_texts[i], rows[i]["answer"]) == "shift"]
    clean, draft, editable = own_drafts(tok, [rows[i] for i in wrong], [start_texts[i] for i in wrong], K, mask)
    allowed = substitution_ids(cfg.vocab_size, sorted(set(tok.all_special_ids) - {tok.eos_token_id} | {mask}))
    ref, ref_resp = own_drafts(tok, rows, [r["answer"] for r in rows], K, mask)[::2]
    corrupt = corrupt_blocks(ref, ref_resp, K, mask, 1.0, allowed, torch.Generator().manual_seed(0))
    out = {}
    for name, (c, d, e) in (("own", (clean, draft, editable)), ("corrupt", (ref, corrupt, ref_resp))):
        nxt, pred = edit_round(model, d, c, e, K)
        labels = block_labels(d, c, K, mask, dele, ins)
        for op, tid in (("delete", dele), ("insert", ins)):
            at = e & labels.eq(tid)
            out[f"{name}_{op}_labels"] = int(at.sum())
            out[f"{name}_{op}_acc"] = float(pred[at].eq(tid).float().mean()) if bool(at.any()) else float("nan")
        at = e & (labels.eq(dele) | labels.eq(ins))
        out[f"{name}_edit_acc"] = float(pred[at].eq(labels[at]).float().mean()) if bool(at.any()) else float("nan")
        fixed = (nxt.eq(c) | ~e).all(-1)
        if name == "own":
            pos = torch.tensor([wrong.index(i) for i in shifted], dtype=torch.long)
            out["own_shift_repaired_1"] = float(fixed[pos].float().mean()) if len(shifted) else float("nan")
    return out


@torch.no_grad()
def edit_probabilities(model_path: str, rows: list[dict], start_texts: list[str], limit: int = 200) -> dict:
    """Mean / max probability of DELETE and INSERT at their labels, and their mean elsewhere in the editable blocks,
    over the start's first `limit` wrong answers (the `labels` drafts): how far an edit is from being the argmax."""
    from ebpo.core.lev_objective import block_labels
    from ebpo.core.objectives import noisy_half_hidden

    model, tok = load_model(model_path).eval(), load_model_tokenizer(model_path)
    cfg = model.config
    wrong = [i for i, (t, r) in enumerate(zip(start_texts, rows)) if t != r["answer"]][:limit]
    clean, draft, editable = own_drafts(tok, [rows[i] for i in wrong], [start_texts[i] for i in wrong],
                                        cfg.block_size, cfg.mask_token_id)
    labels = block_labels(draft, clean, cfg.block_size, cfg.mask_token_id, cfg.delete_token_id, cfg.insert_token_id)
    probs = model.lm_head(noisy_half_hidden(model, draft, clean, cfg.block_size)).float().softmax(-1)
    out = {"model": model_path, "drafts": len(wrong)}
    for op, tid in (("delete", cfg.delete_token_id), ("insert", cfg.insert_token_id)):
        at, rest = editable & labels.eq(tid), editable & ~labels.eq(tid)
        p = probs[..., tid]
        out.update({f"{op}_labels": int(at.sum()), f"{op}_p_at_label": float(p[at].mean()),
                    f"{op}_p_max_at_label": float(p[at].max()), f"{op}_p_elsewhere": float(p[rest].mean())})
    return out


def rollout_shares(model_path: str, rows: list[dict], samples: int = 4) -> dict:
    """Temperature-1 rollouts (ROLLOUT decoding, seeds 0..): share with a DELETE / INSERT, and with one and right."""
    reps = [r for r in rows for _ in range(samples)]
    texts, outs = answers(model_path, reps, seeds=list(range(len(reps))), **ROLLOUT)
    ops = [o.num_deletes + o.num_inserts > 0 for o in outs]
    right = [t == r["answer"] for t, r in zip(texts, reps)]
    n = len(reps)
    return {"rollouts": n, "rollout_accuracy": sum(right) / n, "share_with_op": sum(ops) / n,
            "share_with_op_right": sum(o and r for o, r in zip(ops, right)) / n}


def evaluate_model(model_path: str, rows: list[dict], start: dict, train_rows: list[dict]) -> dict:
    """Every number of the table for one model (module docstring)."""
    res = decode_metrics(model_path, rows, start["kinds"])
    for K in REPAIR_BLOCKS:
        rep = repair(model_path, rows, rounds=1, block_size=K)
        res[f"repair_{K}"], res[f"corrupted_{K}"] = rep["repaired_after_1"], rep["corrupted"]
    res.update(label_accuracy(model_path, rows, start["texts"]))
    if train_rows:
        res.update(rollout_shares(model_path, train_rows))
    else:
        res.update({k: float("nan") for k in ("rollout_accuracy", "share_with_op", "share_with_op_right")})
    return {"model": model_path, **res}


COLUMNS = ("accuracy", "acc_shifted", "acc_start_right", "edit_distance", "dist_shifted", "shift_share", "tpf",
           "deletes_per_seq", "inserts_per_seq", "repair_8", "repair_16", "repair_32", "own_shift_repaired_1",
           "own_delete_acc", "own_insert_acc", "corrupt_delete_acc", "corrupt_insert_acc", "share_with_op",
           "share_with_op_right")


def arm_means(results: dict[str, dict]) -> dict[str, dict]:
    """Means over seeds per arm: NAME-sN -> NAME; each column's mean and its per-seed values."""
    arms: dict[str, list[dict]] = {}
    for name, r in results.items():
        arms.setdefault(re.sub(r"-s\d+$", "", name), []).append(r)
    return {a: {c: {"mean": sum(r[c] for r in rs) / len(rs), "seeds": [r[c] for r in rs]} for c in COLUMNS}
            for a, rs in arms.items()}


def markdown(results: dict[str, dict]) -> str:
    """The per-model table, then the per-arm means (seed values in brackets)."""
    head = "| model | " + " | ".join(COLUMNS) + " |\n|---|" + "---|" * len(COLUMNS) + "\n"
    fmt = lambda v: "-" if isinstance(v, float) and math.isnan(v) else f"{v:.3f}"  # noqa: E731
    lines = [head] + [f"| {n} | " + " | ".join(fmt(r[c]) for c in COLUMNS) + " |\n" for n, r in results.items()]
    lines.append("\n" + head)
    for a, cols in arm_means(results).items():
        cells = [fmt(cols[c]["mean"]) + (" (" + ", ".join(fmt(v) for v in cols[c]["seeds"]) + ")"
                                         if len(cols[c]["seeds"]) > 1 else "") for c in COLUMNS]
        lines.append(f"| {a} | " + " | ".join(cells) + " |\n")
    return "".join(lines)


def label_curve(run_dir: str, out_png: str) -> dict:
    """Held-out DELETE / INSERT label accuracy per chunk and seed, from run_fair_test.sh's labels-sS-cC.json files
    in `run_dir`; plotted to `out_png` (mean over seeds, each seed faint). Returns {op: {seed: [acc per chunk]}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, dict[int, list[float]]] = {"delete": {}, "insert": {}}
    for f in sorted(Path(run_dir).glob("labels-s*-c*.json"), key=lambda p: [int(x) for x in re.findall(r"\d+", p.name)]):
        seed = int(re.search(r"-s(\d+)-", f.name).group(1))
        last = json.loads(f.read_text().strip().splitlines()[-1])
        for op in curves:
            curves[op].setdefault(seed, []).append(last[f"own_{op}_acc"])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for op, color in (("delete", "tab:blue"), ("insert", "tab:red")):
        per_seed = list(curves[op].values())
        n = min(map(len, per_seed))
        for c in per_seed:
            ax.plot(range(1, len(c) + 1), c, color=color, alpha=0.25)
        ax.plot(range(1, n + 1), [sum(c[i] for c in per_seed) / len(per_seed) for i in range(n)], color=color,
                marker="o", label=f"{op.upper()} (mean of {len(per_seed)} seeds)")
    ax.axhline(0.8, color="gray", ls="--", lw=1, label="stopping bar 0.8")
    ax.set_xlabel("Levenshtein SFT chunk (100 steps)")
    ax.set_ylabel("held-out label accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return curves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("gate", "labels", "table", "curve", "probe"))
    ap.add_argument("models", nargs="+", help="gate / labels: model folders; table: NAME=MODEL")
    ap.add_argument("--start", default=None, help="the gate's JSON (labels, table)")
    ap.add_argument("--rows", type=int, default=500)
    ap.add_argument("--eval", default=EVAL, help="held-out rows (jsonl)")
    ap.add_argument("--train", default=TRAIN, help="training rows (jsonl), for the rollout shares")
    ap.add_argument("--rollout-prompts", type=int, default=64, help="table: training prompts x 4 rollouts (0 = none)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cache", default=None, help="table: keep each model's numbers in DIR/NAME.json and reuse them "
                    "(same model path) on a later call")
    args = ap.parse_args()
    if args.command == "curve":  # models[0]: the run folder of run_fair_test.sh; --out: the PNG
        print(json.dumps(label_curve(args.models[0], args.out or "lev_fair_labels.png")))
        return
    torch.manual_seed(0)
    rows = load_rows(args.eval)[: args.rows]
    if args.command == "gate":
        res = decode_metrics(args.models[0], rows, None)
        kinds = res["kinds"]
        print(json.dumps({k: v for k, v in res.items() if k not in ("kinds", "texts")}
                         | {"shifts": kinds.count("shift"), "substitutions": kinds.count("substitution")}))
        if args.out:
            Path(args.out).write_text(json.dumps({"model": args.models[0], **res}) + "\n")
        return
    start = json.loads(Path(args.start).read_text())
    if args.command == "probe":
        for m in args.models:
            print(json.dumps(edit_probabilities(m, rows, start["texts"])), flush=True)
        return
    if args.command == "labels":
        for m in args.models:
            print(json.dumps({"model": m, **label_accuracy(m, rows, start["texts"])}), flush=True)
        return
    train_rows = load_rows(args.train)[: args.rollout_prompts]
    results = {}
    for spec in args.models:
        name, path = spec.split("=", 1)
        cached = Path(args.cache) / f"{name}.json" if args.cache else None
        if cached is not None and cached.exists() and json.loads(cached.read_text())["model"] == path:
            results[name] = json.loads(cached.read_text())
        else:
            results[name] = evaluate_model(path, rows, start, train_rows)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(json.dumps(results[name]) + "\n")
        print(json.dumps({k: v for k, v in results[name].items() if k not in ("kinds", "texts")}), flush=True)
    print(markdown(results))
    if args.out:
        slim = {n: {k: v for k, v in r.items() if k not in ("texts",)} for n, r in results.items()}
        Path(args.out).write_text(json.dumps({"start": args.start, "results": slim,
                                              "arms": arm_means(results)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
