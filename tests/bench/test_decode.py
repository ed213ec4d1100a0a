"""`ebpo bench decode` on dataset prompts: the rows it times, its JSON, and errors that name the file."""
import json
from pathlib import Path

import pytest

from ebpo.bench.decode import main, prompt_ids_from_file
from ebpo.model.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_bench_decode_on_held_out_prompts_writes_every_row(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--model", "preset:tiny", "--prompts", str(ROOT / "examples/data/math_eval.jsonl"), "--batch", "3",
                 "--new-tokens", "8", "--presets", "m2t,quality", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompts"].endswith("math_eval.jsonl")
    plan = [(r["preset"], r["batch"], r["cache"]) for r in result["rows"]]
    assert plan == [("m2t", 1, True), ("m2t", 1, False), ("m2t", 3, True), ("m2t", 3, False),
                    ("quality", 1, True), ("quality", 1, False), ("quality", 3, True)]
    for r in result["rows"]:  # every row decodes the same 3 prompts, batched or one at a time
        assert r["tokens"] == 8 * 3 and r["tokens_per_s"] > 0 and r["tpf"] > 0
    assert set(result["ratios"]) == {"m2t", "quality"}


def test_prompt_file_errors_name_the_file_and_line(tmp_path):
    tok = load_tokenizer()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "Compute 1+2."}\n{"question": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        prompt_ids_from_file(str(bad), tok, 2)
    short = tmp_path / "short.jsonl"
    short.write_text('{"prompt": "Compute 1+2."}\n')
    with pytest.raises(ValueError, match=r"short\.jsonl: 1 prompts, the batch needs 4"):
        prompt_ids_from_file(str(short), tok, 4)
    ids = prompt_ids_from_file(str(short), tok, 1)
    assert len(ids) == 1 and len(ids[0]) > len("Compute 1+2.")  # chat template around the text


def test_bench_decode_block_routing_compares_capacities(tmp_path):
    out = tmp_path / "routing.json"
    assert main(["--model", "preset:tiny", "--block-routing", "0,3", "--batch", "2", "--new-tokens", "8",
                 "--presets", "m2t", "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["block_routing"]
    assert [(r["capacity"], r["batch"]) for r in rows] == [(0, 1), (3, 1), (0, 2), (3, 2)]
    on = [r for r in rows if r["capacity"] == 3]
    assert all(r["experts_per_block_max"] <= 3 and r["tokens_per_s"] > 0 for r in on)
    assert max(r["experts_per_block_max"] for r in rows if r["capacity"] == 0) > 3
