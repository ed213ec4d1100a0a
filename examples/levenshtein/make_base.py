"""Name the edit-control tokens in a trained tiny model: `python examples/levenshtein/make_base.py SRC DST`.

Copies the model folder SRC (e.g. ebpo/assets/tiny-sft) to DST with `delete_token_id` / `insert_token_id` set
to the character tokenizer's ids (105, 106: ids that were unused, so the weights and every output of SRC are
unchanged) and the tokenizer that names them. Levenshtein SFT (recipes/sft_tiny_lev.yaml) starts from DST.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ebpo.model.loading import load_model
from ebpo.model.tokenizer import DELETE, INSERT, build_tokenizer


def main(src: str, dst: str) -> Path:
    model = load_model(src)
    tok = build_tokenizer()
    model.config.delete_token_id, model.config.insert_token_id = tok.convert_tokens_to_ids([DELETE, INSERT])
    model.config.validate()
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return Path(dst)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(main(sys.argv[1], sys.argv[2]))
