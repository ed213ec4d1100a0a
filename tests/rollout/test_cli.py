"""`ebpo generate` (rollout/cli.py) run in this process with the model, the decoder and the multi-turn loop
replaced by recorders: which prompts, ids, seeds, config and callbacks reach the
decoder, what is printed in each output mode, the errors, how the model is chosen, and the multi-turn path."""
import argparse
import dataclasses
import json
from types import SimpleNamespace

import pytest

import rollout.cli as cli
import rollout.decoder as decoder
import rollout.multiturn as multiturn
import rollout.show as show
from rollout.config import DecodeConfig
from rollout.decoder import GenerationOutput


class Tok:
    def __init__(self):
        self.chat = []

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, **kw):
        self.chat.append((messages, kw))
        return "<user>" + messages[0]["content"]


def out(i, text="t"):
    return GenerationOutput(prompt_ids=[i], token_ids=[i, i + 1], text=f"{text}{i}", num_forwards=3 + i, tpf=2 / 3,
                            num_edits=i, num_mbe_edits=0, trace=[0, 1], finished_by_eos=bool(i % 2),
                            num_deletes=5, num_inserts=6)


@pytest.fixture()
def rig(monkeypatch):
    """_load and generate replaced: records what main passes them."""
    r = SimpleNamespace(load=[], gen=[], tok=Tok(), model=SimpleNamespace(config=SimpleNamespace(mask_token_id=77)))

    def load(spec, device):
        r.load.append((spec, device))
        return r.model, r.tok

    def generate(model, ids, config, **kw):
        r.gen.append(dict(model=model, ids=ids, config=config, **kw))
        return [out(i) for i in range(len(ids))]

    monkeypatch.setattr(cli, "_load", load)
    monkeypatch.setattr(decoder, "generate", generate)
    return r


def test_defaults_reach_the_decoder(rig, capsys):
    assert cli.main(["--prompt", "ab", "--prompt", "c"]) == 0
    assert rig.load == [(None, "cpu")]
    (call,) = rig.gen
    assert call["model"] is rig.model and call["tokenizer"] is rig.tok
    assert call["ids"] == [[97, 98], [99]]
    assert call["config"] == DecodeConfig.preset("quality")
    assert call["seeds"] == [0, 1] and "on_step" not in call
    assert capsys.readouterr().out == "t0\nt1\n"


def test_options_reach_the_decoder(rig, capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("  first  \n\n   \nsecondX\n")
    assert cli.main(["--model", "M", "--device", "meta", "--prompts-file", str(f), "--prompt", "x", "--mode", "m2t",
                     "--set", "top_k=5", "--set", "tau_edit=0.25", "--max-new-tokens", "9", "--temperature", "0.5",
                     "--seed", "7", "--json"]) == 0
    assert rig.load == [("M", "meta")]
    (call,) = rig.gen
    assert call["ids"] == [[120], [ord(c) for c in "  first  "], [ord(c) for c in "secondX"]]
    assert call["config"] == DecodeConfig.preset("m2t", top_k=5, tau_edit=0.25, max_new_tokens=9, temperature=0.5)
    assert call["seeds"] == [7, 8, 9]
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines == [{"prompt": p, **json.loads(json.dumps(dataclasses.asdict(out(i))))}
                     for i, p in enumerate(["x", "  first  ", "secondX"])]


def test_the_flags_override_set(rig):
    assert cli.main(["--prompt", "x", "--set", "max_new_tokens=3", "--max-new-tokens", "4",
                     "--set", "temperature=0.1", "--temperature", "0.2"]) == 0
    cfg = rig.gen[0]["config"]
    assert (cfg.max_new_tokens, cfg.temperature) == (4, 0.2)


def test_chat_template(rig):
    assert cli.main(["--prompt", "hi", "--prompt", "yo", "--chat"]) == 0
    assert rig.tok.chat == [([{"role": "user", "content": t}], dict(tools=None, add_generation_prompt=True,
                                                                    tokenize=False)) for t in ("hi", "yo")]
    assert rig.gen[0]["ids"] == [[ord(c) for c in "<user>hi"], [ord(c) for c in "<user>yo"]]


@pytest.mark.parametrize("lev", [False, True])
def test_show_feeds_the_canvas_view_and_prints_stats(rig, monkeypatch, capsys, lev):
    views = []

    class View:
        def __init__(self, tok, mask_id, delay=None):
            self.args = (tok, mask_id, delay)
            views.append(self)

        def __enter__(self):
            self.entered = True
            return self

        def __exit__(self, *exc):
            self.exited = True

        def update(self, ev):
            pass

    monkeypatch.setattr(show, "CanvasView", View)
    argv = ["--prompt", "a", "--prompt", "b", "--show", "--delay", "0.5"] + (["--set", "tau_delete=0.4"] if lev else [])
    assert cli.main(argv) == 0
    (v,) = views
    assert v.args == (rig.tok, 77, 0.5) and v.entered and v.exited
    assert rig.gen[0]["on_step"] == v.update and rig.gen[0]["seeds"] == [0, 1]
    assert rig.gen[0]["model"] is rig.model and rig.gen[0]["tokenizer"] is rig.tok
    assert rig.gen[0]["config"] == DecodeConfig.preset("quality", **({"tau_delete": 0.4} if lev else {}))
    extra = ", deletes 5, inserts 6" if lev else ""
    assert capsys.readouterr().out == "".join(f"'t{i}'  (forwards {3 + i}, TPF 0.67, edits {i}{extra})\n"
                                              for i in range(2))


def test_show_default_delay(rig, monkeypatch):
    seen = []
    monkeypatch.setattr(show.CanvasView, "__init__",
                        lambda self, tok, mask_id, delay: (seen.append(delay), setattr(self, "live", None),
                                                           setattr(self, "state", {}))[0])
    monkeypatch.setattr(show.CanvasView, "__enter__", lambda self: self)
    monkeypatch.setattr(show.CanvasView, "__exit__", lambda self, *a: None)
    assert cli.main(["--prompt", "a", "--show"]) == 0
    assert seen == [0.05]


def test_bad_override_is_reported_before_loading(rig, capsys):
    assert cli.main(["--prompt", "x", "--set", "tau=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ebpo generate: DecodeConfig: unknown field(s) ['tau']") and err.endswith("\n")
    assert cli.main(["--prompt", "x", "--set", "tau_mask=2"]) == 2
    assert capsys.readouterr().err == "ebpo generate: DecodeConfig.tau_mask: got 2.0; allowed: a number in [0, 1]\n"
    assert cli.main(["--prompt", "x", "--temperature", "-1"]) == 2
    assert "DecodeConfig.temperature" in capsys.readouterr().err
    assert rig.load == [] and rig.gen == []


def test_prompt_errors(rig, tmp_path):
    with pytest.raises(SystemExit) as err:
        cli.main([])
    assert err.value.code == "ebpo generate: give at least one --prompt or a --prompts-file"
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(SystemExit) as err:
        cli.main(["--prompts-file", str(tmp_path / "blank.txt")])
    assert err.value.code == "ebpo generate: give at least one --prompt or a --prompts-file"
    with pytest.raises(SystemExit) as err:
        cli.main(["--prompts-file", str(tmp_path / "none.txt")])
    assert err.value.code == f"ebpo generate: --prompts-file {tmp_path / 'none.txt'} does not exist"
    with pytest.raises(SystemExit) as err:
        cli.main(["--prompts-file", str(tmp_path)])  # a folder is not a prompts file
    assert "does not exist" in str(err.value.code)
    assert rig.load == []


def test_parser_help_and_parents():
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--env")
    p = cli._parser((parent,))
    assert p.prog == "ebpo generate" and p.description == "Draft-and-edit decoding of LLaDA2.x models."
    a = p.parse_args(["--env", "calc"])
    assert a.env == "calc" and a.prompt == [] and a.set == [] and a.prompts_file is None
    assert (a.model, a.mode, a.max_new_tokens, a.temperature, a.seed, a.delay, a.device) == \
        (None, "quality", None, None, 0, 0.05, "cpu")
    assert (a.chat, a.show, a.json) == (False, False, False)
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "fast"])
    assert [c for c in p._option_string_actions["--mode"].choices] == ["m2t", "quality", "speed"]
    b = p.parse_args(["--chat", "--show", "--json", "--seed", "4", "--delay", "0.1", "--max-new-tokens", "8",
                      "--temperature", "0.5"])
    assert (b.chat, b.show, b.json, b.seed, b.delay, b.max_new_tokens, b.temperature) == \
        (True, True, True, 4, 0.1, 8, 0.5)
    helps = {a.dest: a.help for a in p._actions}
    assert helps == HELP
    text = " ".join(p.format_help().split())
    assert all(" ".join(h.split()).replace("%%", "%") in text for h in HELP.values() if h)
    assert p._option_string_actions["--set"].metavar == "KEY=VALUE"


HELP = {  # the documented options, as `ebpo generate --help` lists them
    "help": "show this help message and exit", "env": None,
    "model": "model folder, 'tiny-sft' or 'preset:NAME[@seed]' (default: the shipped tiny checkpoint, else a "
             "randomly initialised tiny model)",
    "prompt": "a prompt (repeatable)", "prompts_file": "a text file with one prompt per line",
    "mode": "decoding preset", "set": "override a DecodeConfig field, e.g. --set tau_edit=0.3 (repeatable)",
    "max_new_tokens": None, "temperature": "> 0 samples (default: greedy)", "seed": "sequence i uses seed + i",
    "chat": "wrap each prompt with the tokenizer's chat template",
    "show": "live view of the canvas as it fills and edits", "delay": "seconds between --show frames",
    "json": "print one JSON object per sequence", "device": None,
}


@pytest.mark.parametrize("shipped", [True, False])
def test_load_picks_the_model(monkeypatch, tmp_path, capsys, shipped):
    import ebpo.model.loading as loading

    calls = []

    class Model:
        def eval(self):
            calls.append("eval")
            return self

    def load_model(spec, device=None):
        calls.append(("model", spec, device))
        return Model()

    monkeypatch.setattr(loading, "load_model", load_model)
    monkeypatch.setattr(loading, "load_model_tokenizer", lambda spec: ("tok", spec))
    (tmp_path / "sft").mkdir()
    if shipped:
        (tmp_path / "sft" / "config.json").write_text("{}")
    monkeypatch.setattr(loading, "TINY_SFT_DIR", tmp_path / "sft")
    model, tok = cli._load(None, "dev")
    want = "tiny-sft" if shipped else "preset:tiny"
    assert isinstance(model, Model) and tok == ("tok", want) and calls == [("model", want, "dev"), "eval"]
    err = capsys.readouterr().err
    assert err == ("" if shipped else "ebpo generate: warning: no shipped tiny checkpoint found; using a randomly "
                   "initialised tiny model (output is noise). Pass --model DIR.\n")
    calls.clear()
    _, tok = cli._load("preset:x@3", "cpu")
    assert tok == ("tok", "preset:x@3") and calls == [("model", "preset:x@3", "cpu"), "eval"]


class Env:
    made = []

    def __init__(self, specs=None, close=True):
        self.specs, self.closed = specs, False
        if close:
            self.close = lambda: setattr(self, "closed", True)
        Env.made.append(self)


def test_env_tools():
    Env.made = []
    assert cli._env_tools(lambda: Env(specs=({"name": "a"}, {"name": "b"}))) == [{"name": "a"}, {"name": "b"}]
    assert Env.made[-1].closed
    assert cli._env_tools(lambda: Env(specs=[])) is None and Env.made[-1].closed
    assert cli._env_tools(lambda: Env(specs=None, close=False)) is None
    assert cli._env_tools(lambda: SimpleNamespace()) is None  # an environment without tools at all
    e = Env(specs=[1])
    e.close = "not callable"
    assert cli._env_tools(lambda: e) == [1]

    class Boom(Env):
        @property
        def specs(self):
            raise RuntimeError("boom")

        @specs.setter
        def specs(self, v):
            pass

    with pytest.raises(RuntimeError):
        cli._env_tools(lambda: Boom())
    assert Env.made[-1].closed  # closed even when reading the specs fails


class Traj:
    def __init__(self, i, turns):
        self.i, self.turns = i, turns

    def to_dict(self):
        return {"i": self.i, "n": len(self.turns)}


@pytest.mark.parametrize("temperature", [None, 0.7])
def test_multiturn_path(rig, monkeypatch, capsys, temperature):
    rec = {}

    def start(envs, rows, ids, tok, seeds, template):
        rec["start"] = (envs, rows, ids, tok, seeds, template)
        return [i + [0] for i in ids]

    def gen_mt(model, prompts, envs, config, mt, tokenizer, seeds):
        rec["gen"] = (model, prompts, envs, config, mt, tokenizer, seeds)
        return [Traj(0, [SimpleNamespace(text="A"), SimpleNamespace(text="B"), SimpleNamespace(text="last")]),
                Traj(1, [])]

    monkeypatch.setattr(multiturn, "start_episodes", start)
    monkeypatch.setattr(multiturn, "generate_multiturn", gen_mt)
    Env.made = []
    argv = ["--prompt", "p", "--prompt", "q", "--chat", "--seed", "2"]
    if temperature:
        argv += ["--temperature", str(temperature)]
    assert cli.main(argv, env_factory=lambda: Env(specs=[{"name": "calc"}]),
                    multiturn={"max_turn_tokens": 8, "observation_template": "<o>{observation}</o>"}) == 0
    assert rig.gen == []  # the single-turn decoder is not used
    assert rig.tok.chat[0][1]["tools"] == [{"name": "calc"}] and Env.made[0].closed
    envs, rows, ids, tok, seeds, template = rec["start"]
    assert envs == Env.made[1:] and len(envs) == 2 and rows == [{"prompt": "<user>p"}, {"prompt": "<user>q"}]
    assert ids == [[ord(c) for c in "<user>p"], [ord(c) for c in "<user>q"]] and tok is rig.tok
    assert seeds == [2, 3] and template == "<o>{observation}</o>"
    model, prompts, envs2, config, mt, tokenizer, seeds = rec["gen"]
    assert model is rig.model and envs2 == envs and prompts == [i + [0] for i in ids] and tokenizer is rig.tok
    assert config == DecodeConfig.preset("quality", **({"temperature": temperature} if temperature else {}))
    assert mt == multiturn.MultiTurnConfig(max_turn_tokens=8, observation_template="<o>{observation}</o>")
    assert seeds == ([2, 3] if temperature else None)
    assert capsys.readouterr().out == "last\n\n"


def test_multiturn_json_and_show(rig, monkeypatch, capsys):
    monkeypatch.setattr(multiturn, "start_episodes", lambda envs, rows, ids, tok, seeds, template: ids)
    monkeypatch.setattr(multiturn, "generate_multiturn",
                        lambda *a, **k: [Traj(0, [SimpleNamespace(text="A")]), Traj(1, [])])
    assert cli.main(["--prompt", "p", "--prompt", "q", "--json"], env_factory=Env) == 0
    assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == [{"i": 0, "n": 1}, {"i": 1, "n": 0}]
    assert Env.made and rig.tok.chat == []  # no --chat: no template, no tools asked for
    drawn = []
    monkeypatch.setattr(show, "render_trajectory", lambda d, tok: drawn.append((d, tok)) or f"TRAJ{d['i']}")
    assert cli.main(["--prompt", "p", "--prompt", "q", "--show"], env_factory=Env) == 0
    assert drawn == [({"i": 0, "n": 1}, rig.tok), ({"i": 1, "n": 0}, rig.tok)]
    assert capsys.readouterr().out == "TRAJ0\nTRAJ1\n"  # the rendering only, no plain text after it
    assert cli.main(["--prompt", "p", "--show", "--json"], env_factory=Env) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ['{"i": 0, "n": 1}', '{"i": 1, "n": 0}']
