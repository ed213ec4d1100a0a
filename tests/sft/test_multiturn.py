"""Multi-turn SFT data (ebpo.sft.multiturn): loss on the assistant turns only, every turn padded to a block boundary."""
import json

import torch

from ebpo.core.turns import OBSERVATION_TEMPLATE
from ebpo.infra.data import collate
from ebpo.model.tokenizer import load_tokenizer
from ebpo.sft.config import SFTConfig, SFTDataConfig
from ebpo.sft.multiturn import encode_messages
from ebpo.sft.trainer import build_examples

K = 8
MESSAGES = [{"role": "user", "content": "Compute 482*37."},
            {"role": "assistant", "content": '<tool_call>{"name":"calc","arguments":{"expr":"482*37"}}</tool_call>'},
            {"role": "tool", "content": "17834"},
            {"role": "assistant", "content": "\\boxed{17834}"}]


def test_loss_only_on_assistant_turns_which_end_on_block_boundaries():
    tok = load_tokenizer()
    ids, mask = encode_messages(tok, MESSAGES, K)
    eos = tok.decode([tok.eos_token_id])
    # split the sequence into maximal runs of equal mask and read them back as text
    runs, cur, start = [], mask[0], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != cur:
            runs.append((cur, tok.decode(ids[start:i]), start, i))
            if i < len(ids):
                cur, start = mask[i], i
    assert [r[0] for r in runs] == [False, True, False, True]
    assert runs[0][1] == "<|user|>Compute 482*37.<|role_end|><|assistant|>"
    assert runs[1][1].startswith(MESSAGES[1]["content"] + eos) and set(runs[1][1][len(MESSAGES[1]["content"]):]) <= set(eos)
    assert runs[2][1] == OBSERVATION_TEMPLATE.format(observation="17834")
    assert runs[3][1].startswith("\\boxed{17834}" + eos)
    assert runs[1][3] % K == 0 and runs[3][3] % K == 0  # each turn ends on a block boundary


def test_collate_keeps_explicit_masks_and_trainer_builds_them(tmp_path):
    tok = load_tokenizer()
    ex = encode_messages(tok, MESSAGES, K)
    ids, resp = collate([ex, (tok("ab", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], 1)], K,
                        tok.pad_token_id, eos_id=tok.eos_token_id, mask_id=2)
    assert resp[0, :len(ex[1])].tolist() == ex[1] and not resp[0, len(ex[1]):].any()
    assert resp[1].tolist()[:K] == [False] + [True] * (K - 1)  # single-turn rows as before
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "Compute 482*37.", "messages": MESSAGES}) + "\n")
    cfg = SFTConfig(kind="sft", data=SFTDataConfig(train=str(f), multi_turn=True))
    (got,) = build_examples(cfg, tok, [json.loads(f.read_text())], K)
    assert got == ex and torch.tensor(got[1]).any()
