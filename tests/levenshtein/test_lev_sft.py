"""SFT with Levenshtein rounds (ebpo/core/lev_objective.py): drafts, labels, loss, and the trainer wiring."""
import json

import torch

from ebpo.core.lev_objective import apply_predictions, block_labels, corrupt_blocks, levenshtein_loss
from ebpo.core.levenshtein import rounds_to_target
from ebpo.core.objectives import ObjectiveConfig
from ebpo.model import LLaDA2MoeModelLM, tiny_config
from ebpo.sft.trainer import run

K, MASK, DEL, INS = 8, 2, 105, 106


def _batch():
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(10, 60, (6, 32), generator=g)
    resp = torch.zeros(6, 32, dtype=torch.bool)
    for b, p in enumerate([3, 8, 11, 0, 5, 16]):
        resp[b, p:] = True
    return clean, resp


def test_corruptions_keep_prompts_and_block_lengths_and_are_seeded():
    clean, resp = _batch()
    allowed = torch.arange(10, 60)
    a = corrupt_blocks(clean, resp, K, MASK, 0.9, allowed, torch.Generator().manual_seed(1))
    b = corrupt_blocks(clean, resp, K, MASK, 0.9, allowed, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and a.shape == clean.shape
    assert torch.equal(a[~resp], clean[~resp])  # prompts untouched
    assert not torch.equal(a, clean)
    # every corrupted block goes back to its target under label rounds
    rounds = rounds_to_target(a.view(-1, K), clean.view(-1, K), MASK, max_rounds=8)
    assert (rounds <= 8).all()


def test_labels_of_a_duplicated_token_delete_it_and_prediction_applies():
    clean = torch.tensor([[20, 21, 22, 23, 24, 25, 26, 27]])
    draft = torch.tensor([[20, 21, 21, 22, 23, 24, 25, 26]])  # 21 repeated, 27 pushed out
    lab = block_labels(draft, clean, K, MASK, DEL, INS)
    assert lab.tolist() == [[20, 21, DEL, 22, 23, 24, 25, 26]]
    nxt = apply_predictions(draft, lab, K, MASK, DEL, INS, torch.ones_like(draft, dtype=torch.bool))
    assert nxt.tolist() == [[20, 21, 22, 23, 24, 25, 26, MASK]]


def test_levenshtein_loss_backprops_and_counts_edit_labels():
    torch.manual_seed(0)
    model = LLaDA2MoeModelLM(tiny_config())
    clean, resp = _batch()
    cfg = ObjectiveConfig(lev_weight=1.0, lev_source="mixed", lev_rate=0.9, lev_rounds=2, lev_fraction=1.0)
    loss, m = levenshtein_loss(model, model.lm_head, clean, resp, clean.masked_fill(resp, MASK), cfg, K, MASK, DEL,
                               INS, torch.arange(10, 60), torch.Generator().manual_seed(2))
    loss.backward()
    assert torch.isfinite(loss) and model.lm_head.weight.grad[DEL].abs().sum() > 0
    assert m["lev/lev_deletes_round1"] + m["lev/lev_inserts_round1"] > 0
    assert "loss/lev_round2" in m


def test_trainer_runs_levenshtein_rounds(tmp_path):
    rows = [{"prompt": f"Compute {a}+{b}.", "response": f"\\boxed{{{a + b}}}"} for a in range(10, 16) for b in range(20, 24)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["model=preset:tiny@0", f"data.train={tmp_path / 'train.jsonl'}", "data.max_len=48", "trainer.batch_size=8",
              "trainer.steps=3", "trainer.log_every=1", "trainer.tracking=none", "trainer.progress=false",
              "trainer.plots=false", "trainer.num_threads=1", "eval.presets=[]"]
    out = run(None, common + [f"trainer.run_dir={tmp_path / 'lev'}", "objective.lev_weight=1.0"])
    m = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("loss/lev" in r for r in m)
    base = run(None, common + [f"trainer.run_dir={tmp_path / 'base'}"])
    b = [json.loads(x) for x in (base / "metrics.jsonl").read_text().splitlines()]
    assert "loss/lev" not in b[0] and b[0]["loss/m2t"] == m[0]["loss/m2t"]  # the first round is today's
