from ebpo.model import tiny_config
from ebpo.model.tokenizer import build_tokenizer, load_tokenizer


def test_shipped_tokenizer_matches_build_and_preset_ids():
    built, shipped = build_tokenizer(), load_tokenizer()
    cfg = tiny_config()
    for tok in (built, shipped):
        assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (
            cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id)
        assert len(tok) <= cfg.vocab_size
    text = "def f(x):\n\treturn x*2  # ok\nWhat is 12+7? \\boxed{19}"
    assert shipped.decode(shipped(text)["input_ids"]) == text
    assert shipped(text)["input_ids"] == built(text)["input_ids"]


def test_chat_template_round_trip():
    tok = load_tokenizer()
    out = tok.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True, tokenize=False)
    assert out == "<|user|>1+1?<|role_end|><|assistant|>"
    ids = tok(out)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|user|>") and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
