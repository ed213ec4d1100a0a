"""The project's own character-level tokenizer for its small synthetic tasks.

Built with the `tokenizers` library and wrapped as a `PreTrainedTokenizerFast`, so it saves and loads
like any Hugging Face tokenizer. Ids 0-7 are special (see SPECIAL_TOKENS); every printable ASCII
character, newline and tab has its own id (8-104), so any task text round-trips exactly. The two
Levenshtein edit-control tokens (EDIT_TOKENS, issue 29) take ids 105 and 106, the first two of the
vocabulary's unused ids (the tiny preset has 128): ids 0-104 are unchanged, so models trained before them
keep their outputs bit for bit. Real LLaDA2 models use
their own tokenizer through `AutoTokenizer.from_pretrained(path)`.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS, EOS, MASK, UNK = "<|startoftext|>", "<|endoftext|>", "<|mask|>", "<|unk|>"
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>", "<|role_end|>")
SPECIAL_TOKENS = (BOS, EOS, MASK, UNK) + ROLE_TOKENS  # ids 0..7, matching ebpo/presets/tiny.json
CHARACTERS = ["\n", "\t"] + [chr(c) for c in range(32, 127)]
DELETE, INSERT = "<|delete|>", "<|insert|>"
EDIT_TOKENS = (DELETE, INSERT)  # ids 105, 106 (after the characters): delete_token_id / insert_token_id

# Tools (`apply_chat_template(..., tools=specs)`, the JSON-schema list of an environment) open the conversation as a
# system turn, one tool's `function` object as JSON per line, so the model reads every tool's name, description and
# parameters; without tools the template renders exactly what it always did. Shipped checkpoints keep the template
# they were trained with (their folders' own chat_template.jinja, which has no tools: docs/rl.md).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>' }}{% for tool in tools %}"
    "{{ (tool.function if tool.function is defined else tool) | tojson }}{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% endfor %}{{ '<|role_end|>' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|role_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer from scratch (deterministic: same ids every time)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    for edit in EDIT_TOKENS:  # appended, never inserted: earlier ids must not move
        vocab[edit] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS) + list(EDIT_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token=UNK, mask_token=MASK,
        additional_special_tokens=list(ROLE_TOKENS) + list(EDIT_TOKENS), padding_side="right")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer folder; None gives the shipped character tokenizer (built if absent)."""
    if path is None:
        if (DEFAULT_DIR / "tokenizer.json").exists():
            return PreTrainedTokenizerFast.from_pretrained(str(DEFAULT_DIR))
        return build_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
