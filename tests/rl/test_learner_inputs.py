"""What reaches the learner: the sampled canvas of the last block, block sizes, over-long prompts."""
import json

import pytest
import torch

from ebpo.infra.config import ConfigError, load_config
from ebpo.infra.data import DataError, collate, filter_overlong_prompts
from ebpo.rl.records import build_learner_batch
from ebpo.rl.config import RLConfig, model_block_size

EOS, MASK = 1, 2


# ----------------------------------------------------------------------------------------------------
# The last block: the learner scores the canvas the sampler wrote; SFT the EOS fill; cut data hides it
# ----------------------------------------------------------------------------------------------------

def test_learner_batch_is_the_sampled_canvas_block_for_block():
    from ebpo.model.loading import load_model
    from rollout import DecodeConfig, generate

    model = load_model("preset:tiny@3").eval()
    K = model.config.block_size
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
    final = {}

    def on_step(ev):
        final[ev.seq] = list(ev.canvas)

    cfg = DecodeConfig.preset("quality", temperature=1.0, max_new_tokens=9)
    with torch.no_grad():
        outs = generate(model, prompts, cfg, seeds=[1, 2, 3], on_step=on_step)
    batch = build_learner_batch(prompts, [o.token_ids for o in outs], torch.zeros(3), torch.arange(3), pad_id=EOS,
                                tail_ids=[o.tail_ids for o in outs])
    n_cut = 0
    for i, (p, o) in enumerate(zip(prompts, outs)):
        end = len(p) + len(o.token_ids)
        block_end = -(-end // K) * K
        assert o.tail_ids == final[i][end:block_end]  # the rest of the last block, as sampled
        assert batch.input_ids[i, :block_end].tolist() == final[i][:block_end]
        assert batch.response_mask[i].nonzero().flatten().tolist() == list(range(len(p), block_end))
        assert int(batch.response_lens[i]) == len(o.token_ids)
        n_cut += not o.finished_by_eos
    assert n_cut > 0 and any(o.tail_ids for o in outs)  # a cut response with real tokens after the cut


def test_rl_and_sft_agree_on_the_last_block():
    """An EOS-ended response whose block the sampler filled with EOS: RL batch == SFT collate."""
    K = 4
    prompt, response = [5, 6, 7], [20, 21, 22, 23, EOS]  # ends at position 7, inside block 1
    tail = [EOS] * (-(-8 // K) * K - 8)
    rl = build_learner_batch([prompt], [response], torch.zeros(1), torch.zeros(1), pad_id=EOS, tail_ids=[tail])
    ids, resp = collate([(prompt + response, len(prompt))], K, pad_id=EOS, eos_id=EOS, mask_id=MASK)
    n = rl.input_ids.shape[1]
    assert torch.equal(ids[:, :n], rl.input_ids) and torch.equal(resp[:, :n], rl.response_mask)
    assert not resp[:, n:].any()


def test_sft_collate_scores_the_eos_tail_and_hides_a_cut_tail():
    K = 4
    ended = ([9, 9, 30, 31, 32, EOS], 2)  # EOS at position 5: positions 6, 7 are EOS fill, scored
    cut = ([9, 9, 9, 40, 41], 3)          # cut at max_len: no real tokens at 5..7
    ids, resp = collate([ended, cut], K, pad_id=EOS, eos_id=EOS, mask_id=MASK)
    assert ids[0].tolist() == [9, 9, 30, 31, 32, EOS, EOS, EOS]
    assert resp[0].tolist() == [False, False] + [True] * 6
    assert ids[1].tolist() == [9, 9, 9, 40, 41, MASK, MASK, MASK]  # not yet decoded: mask tokens
    assert resp[1].tolist() == [False] * 3 + [True, True] + [False] * 3
    # without eos_id/mask_id (CPT chunks, old callers) every last block is scored whole
    _, resp_plain = collate([ended, cut], K, pad_id=EOS)
    assert resp_plain[1].tolist() == [False] * 3 + [True] * 5


# ----------------------------------------------------------------------------------------------------
# Block sizes and Multi-Block Editing, checked at start-up
# ----------------------------------------------------------------------------------------------------

def test_block_size_mismatch_fails_naming_both_keys():
    assert model_block_size("tiny-sft-mixed") == 8 and model_block_size("preset:mini@1") == 32
    for overrides in (["learner.block_size=4"], ["rollout.decode.block_size=4"],
                      ["learner.block_size=16", "rollout.decode.block_size=8"]):
        cfg = load_config(RLConfig, "recipes/quickstart.yaml", overrides)
        with pytest.raises(ConfigError) as e:
            cfg.check_against_model(model_block_size(cfg.model))
        assert "learner.block_size" in str(e.value) and "rollout.decode.block_size" in str(e.value)
    for overrides in ([], ["learner.block_size=8"], ["rollout.decode.block_size=8"],
                      ["learner.block_size=4", "rollout.decode.block_size=4"]):
        cfg = load_config(RLConfig, "recipes/quickstart.yaml", overrides)
        assert cfg.check_against_model(8) == []


def test_shipped_rl_recipes_pass_the_block_size_check():
    for name in ("quickstart", "quickstart_code", "rl_math_llada21_mini", "rl_code_llada21_mini"):
        cfg = load_config(RLConfig, f"recipes/{name}.yaml")
        assert cfg.check_against_model(32 if "llada21" in name else 8) == [], name


def test_multi_block_editing_rollouts_warn():
    cfg = load_config(RLConfig, "recipes/quickstart.yaml", ["rollout.decode.mbe_window=2"])
    (warning,) = cfg.check_against_model(8)
    assert "mbe_window" in warning and "Multi-Block Editing" in warning


# ----------------------------------------------------------------------------------------------------
# Over-long prompts: filtered with a count, or refused
# ----------------------------------------------------------------------------------------------------

def test_filter_overlong_prompts_counts_or_refuses():
    rows = [{"prompt": "x" * n} for n in (3, 12, 5, 30)]
    kept, dropped = filter_overlong_prompts(rows, lambda r: len(r["prompt"]), 10, "filter", "data.train")
    assert kept == [rows[0], rows[2]] and dropped == 2
    with pytest.raises(DataError, match=r"data.train row 1: the prompt has 12 tokens.*max_prompt_tokens = 10"):
        filter_overlong_prompts(rows, lambda r: len(r["prompt"]), 10, "error", "data.train")
    with pytest.raises(DataError, match="all 4 prompts"):
        filter_overlong_prompts(rows, lambda r: len(r["prompt"]), 2, "filter", "data.train")


def test_trainer_drops_overlong_prompts_at_load_time_and_counts_them(tmp_path):
    from ebpo.model.loading import load_model_tokenizer
    from ebpo.rl.prompts import Prompts

    rows = [{"prompt": "1+2", "answer": "3"}, {"prompt": "9" * 200, "answer": "9"}, {"prompt": "4+4", "answer": "8"}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tokenizer = load_model_tokenizer("tiny-sft")  # the loading step only: no Ray, no actors
    prompts = Prompts(load_config(RLConfig, "recipes/quickstart.yaml", ["data.max_prompt_tokens=64"]).data, tokenizer)
    kept = prompts.load(str(path), "train")
    assert [r["prompt"] for r in kept] == ["1+2", "4+4"]
    assert prompts.metrics == {"data/overlong_train_prompts": 1.0}
    ids = prompts.encode(kept[0])
    assert tokenizer.decode(ids).startswith("<|user|>")  # never cut: the chat header is there
    strict = load_config(RLConfig, "recipes/quickstart.yaml", ["data.max_prompt_tokens=64", "data.overlong_prompts=error"])
    with pytest.raises(DataError, match="data.train row 1"):
        Prompts(strict.data, tokenizer).load(str(path), "train")
