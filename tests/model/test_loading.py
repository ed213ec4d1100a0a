"""The checkpoints shipped in ebpo/assets (ebpo.model.loading): names resolve, and the quickstart's starting model behaves as
its recipe says (it answers some questions bare and works the others)."""
import json
from pathlib import Path

import pytest

from ebpo.model.loading import SHIPPED_MODELS, load_model, load_model_tokenizer, resolve_model_path

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(SHIPPED_MODELS))
def test_shipped_names_resolve_to_folders_with_weights(name):
    folder = Path(resolve_model_path(name))
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def test_unknown_model_name_lists_the_shipped_ones():
    with pytest.raises(FileNotFoundError, match="tiny-sft-mixed"):
        load_model("tiny-sft-mixd")


@pytest.mark.parametrize("task", ["math", "code"])
def test_mixed_model_answers_some_questions_bare_and_works_the_others(task):
    """Greedy Quality Mode on 60 held-out rows: tiny-sft-mixed (the RL quickstarts' start) mixes both styles,
    and its full answers (working shown; a `def`) are far more often right than its bare ones; tiny-sft
    (trained on full answers only) never answers bare."""
    from ebpo.sft.evaluation import evaluate_rows

    rows = [json.loads(line) for line in (ROOT / f"examples/data/{task}_eval.jsonl").read_text().splitlines()[:60]]

    def is_bare(completion: str) -> bool:
        text = completion.lstrip()
        return text.startswith("\\boxed") if task == "math" else not text.startswith("def ")

    styles = {}
    for name in ("tiny-sft-mixed", "tiny-sft"):
        result = evaluate_rows(load_model(name), load_model_tokenizer(name), rows, "quality",
                               {"max_new_tokens": 40}, keep_samples=len(rows))
        styles[name] = ([is_bare(s["completion"]) for s in result.samples], result.correct)
    bare, correct = styles["tiny-sft-mixed"]
    n_bare = sum(bare)
    assert 5 <= n_bare <= 50, n_bare
    acc_bare = sum(c for b, c in zip(bare, correct) if b) / n_bare
    acc_full = sum(c for b, c in zip(bare, correct) if not b) / (len(rows) - n_bare)
    assert acc_full >= 0.7 and acc_bare <= 0.2, (acc_full, acc_bare)
    assert not any(styles["tiny-sft"][0])
