"""DecodeConfig presets/validation/overrides and the `ebpo generate` command."""
import json

import pytest

from rollout import DecodeConfig
from rollout.cli import main
from rollout.config import parse_override


def test_presets_and_overrides():
    q, s, m = (DecodeConfig.preset(n) for n in ("quality", "speed", "m2t"))
    assert (q.tau_mask, q.tau_edit, q.max_post_steps) == (0.7, 0.5, 16)
    assert (s.tau_mask, s.tau_edit, s.max_post_steps) == (0.5, 0.0, 16) and s.editing
    assert m.tau_mask == 0.95 and not m.editing
    assert q.temperature == 0.0 and q.use_cache
    assert DecodeConfig.preset("speed", temperature=0.6).temperature == 0.6


@pytest.mark.parametrize("bad,field", [
    (dict(tau_mask=1.5), "tau_mask"), (dict(num_to_transfer=0), "num_to_transfer"),
    (dict(top_p=0.0), "top_p"), (dict(temperature=-1), "temperature"), (dict(block_size=0), "block_size"),
    (dict(mbe_max_passes=0), "mbe_max_passes"), (dict(use_cache="yes"), "use_cache"),
])
def test_validation_names_the_field(bad, field):
    with pytest.raises(ValueError, match=f"DecodeConfig.{field}"):
        DecodeConfig.preset("quality", **bad)


def test_unknown_names():
    with pytest.raises(ValueError, match="unknown preset"):
        DecodeConfig.preset("fast")
    with pytest.raises(ValueError, match="tau_mask"):  # the error lists the valid fields
        DecodeConfig.preset("quality", tau=0.3)


def test_parse_override():
    assert parse_override("tau_edit=none") == ("tau_edit", None)
    assert parse_override("max_new_tokens=12") == ("max_new_tokens", 12)
    assert parse_override("use_cache=false") == ("use_cache", False)
    assert parse_override("top_p = 0.9") == ("top_p", 0.9)
    with pytest.raises(ValueError, match="max_new_tokens"):
        parse_override("max_new_tokens=abc")


def test_cli_json_and_text(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("1+1=\n\nabc\n")
    assert main(["--model", "preset:tiny", "--prompts-file", str(f), "--prompt", "x", "--mode", "speed",
                 "--set", "max_new_tokens=8", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["prompt"] for x in lines] == ["x", "1+1=", "abc"]  # --prompt first, then the file
    assert all(len(x["token_ids"]) <= 8 and x["num_forwards"] >= 1 for x in lines)


def test_cli_show_and_chat(capsys):
    assert main(["--model", "preset:tiny", "--prompt", "hi", "--chat", "--show", "--delay", "0",
                 "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "forwards" in out and "drafted" in out


def test_cli_bad_override(capsys):
    assert main(["--model", "preset:tiny", "--prompt", "x", "--set", "tau=1"]) == 2
    assert "unknown field" in capsys.readouterr().err
