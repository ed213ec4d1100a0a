"""The project's character-level tokenizer (ebpo.model.tokenizer) and its edit-control tokens: DELETE / INSERT are ids
105 / 106 of the tiny tokenizer, appended without moving any id; a model trained before them still names them, and
the shipped Levenshtein model decodes with them."""
import pytest

from ebpo.model import tiny_config
from ebpo.model.loading import load_model, load_model_tokenizer
from ebpo.model.tokenizer import DELETE, INSERT, build_tokenizer, load_tokenizer


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


def test_tokenizer_appends_the_edit_tokens_without_moving_any_id():
    new, old = build_tokenizer(), load_model_tokenizer("tiny-sft")  # tiny-sft ships the tokenizer it was trained with
    assert new.convert_tokens_to_ids([DELETE, INSERT]) == [105, 106] == [tiny_config().delete_token_id,
                                                                         tiny_config().insert_token_id]
    assert {t: i for t, i in new.get_vocab().items() if i < 105} == old.get_vocab()
    assert load_tokenizer().convert_tokens_to_ids([DELETE, INSERT]) == [105, 106]
    text = "Compute 12+7. 2+7=9 \\boxed{19}"
    assert new(text)["input_ids"] == old(text)["input_ids"]
    assert new.decode([105, 106, 27], skip_special_tokens=True) == "1"


def test_sft_names_the_edit_tokens_of_a_model_trained_before_them():
    from ebpo.sft.trainer import name_edit_tokens

    model = load_model("tiny-sft")
    tok = name_edit_tokens(model.config, load_model_tokenizer("tiny-sft"))
    assert (model.config.delete_token_id, model.config.insert_token_id) == (105, 106)
    assert tok.convert_ids_to_tokens([105, 106]) == [DELETE, INSERT]
    with pytest.raises(ValueError, match="character tokenizer"):
        name_edit_tokens(load_model("tiny-sft").config, tok)  # already names them: not the old vocabulary


def test_shipped_levenshtein_model_names_the_tokens_and_decodes_with_them():
    from rollout import DecodeConfig, generate

    model = load_model("tiny-sft-lev").eval()
    tok = load_model_tokenizer("tiny-sft-lev")
    assert (model.config.delete_token_id, model.config.insert_token_id) == (105, 106)
    assert tok.convert_tokens_to_ids([DELETE, INSERT]) == [105, 106]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Compute 17+88."}], add_generation_prompt=True,
                                     tokenize=False)
    ids = [tok(prompt, add_special_tokens=False)["input_ids"]]
    out = generate(model, ids, DecodeConfig.preset("quality", max_new_tokens=40, tau_delete=0.5, tau_insert=0.5),
                   tokenizer=tok)[0]
    assert 105 not in out.token_ids and 106 not in out.token_ids and out.finished_by_eos
