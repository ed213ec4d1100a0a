"""ebpo.infra.data: row loading with file:line errors, SFT encoding, CPT packing, collation, resumable sampler."""
import json

import pytest

from ebpo.infra.data import DataError, EpochSampler, collate, encode_prompt, encode_sft, load_rows, pack_documents
from ebpo.model.tokenizer import load_tokenizer


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_error_names_file_and_line(tmp_path):
    p = write(tmp_path / "d.jsonl", ['{"prompt": "a", "response": "b"}', "", '{"prompt": "c", response: 1}'])
    with pytest.raises(DataError, match=r"d\.jsonl:3: invalid JSON"):
        load_rows(p)


def test_missing_field_names_file_and_line(tmp_path):
    p = write(tmp_path / "d.jsonl", ['{"prompt": "a", "response": "b"}', '{"prompt": "c"}'])
    with pytest.raises(DataError, match=r"d\.jsonl:2: missing field 'response'"):
        load_rows(p, required=("prompt", "response"))
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unsupported data format"):
        load_rows(write(tmp_path / "d.csv", ["a,b"]))


def test_parquet_json_hf_and_lists(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    assert load_rows(tmp_path / "d.parquet") == rows
    assert load_rows(str(tmp_path / "d.json")) == rows
    assert load_rows(f"hf:{tmp_path / 'hf'}") == rows
    assert len(load_rows([str(tmp_path / "d.json"), str(tmp_path / "d.parquet")])) == 10
    with pytest.raises(DataError, match="not a local dataset folder"):
        load_rows("hf:some/hub-name")


def test_encode_sft_and_collate():
    tok = load_tokenizer()
    ids, plen = encode_sft(tok, "1+2", "\\boxed{3}", max_len=64)
    prompt_text = "<|user|>1+2<|role_end|><|assistant|>"
    assert tok.decode(ids[:plen]) == prompt_text
    assert tok.decode(ids[plen:-1]) == "\\boxed{3}" and ids[-1] == tok.eos_token_id
    assert encode_prompt(tok, "1+2") == ids[:plen]
    short, _ = encode_sft(tok, "1+2", "x" * 100, max_len=20)
    assert len(short) == 20 and short[-1] != tok.eos_token_id  # truncated: no EOS taught
    ex = [(list(range(10, 21)), 4), (list(range(10, 15)), 2)]  # lengths 11 and 5
    input_ids, resp = collate(ex, block_size=4, pad_id=1)
    assert input_ids.shape == (2, 12)
    assert input_ids[1, 5:].eq(1).all()
    assert resp[0].tolist() == [False] * 4 + [True] * 8
    assert resp[1].tolist() == [False] * 2 + [True] * 6 + [False] * 4  # up to the end of the last real block


def test_pack_documents():
    tok = load_tokenizer()
    chunks = pack_documents(tok, ["abc", "defg", "hi"], seq_len=4)
    flat = [t for c in chunks for t in c]
    stream = []
    for text in ("abc", "defg", "hi"):
        stream += tok(text, add_special_tokens=False)["input_ids"] + [1]
    assert all(len(c) == 4 for c in chunks)
    assert flat == stream and len(flat) == 12
    assert len(pack_documents(tok, ["abc", "defg", "h"], seq_len=4)) == 2  # a short tail is dropped


def test_epoch_sampler_covers_and_resumes():
    s = EpochSampler(10, seed=3)
    first = s.take(10)
    assert sorted(first) == list(range(10))
    s.take(4)
    state = s.state()
    rest = s.take(9)
    s2 = EpochSampler(10, seed=3)
    s2.restore(state)
    assert s2.take(9) == rest
