"""rollout/show.py on tiny inputs: the canvas view's pieces, colours, underlines,
header and Levenshtein list after each event, the live display, and a trajectory's rendered turns.

A fake tokenizer decodes id i as "<i>" (id 10 as a text with a newline; id 1 is special and shown by its
token name); each rendered piece is read back with its style from rich's spans.
"""
import io
from types import SimpleNamespace

import pytest
from rich.console import Console
from rich.text import Text

import rollout.show as show
from rollout.show import STYLES, TURN_STYLES, CanvasView, render_trajectory

MASK = 99


class Tok:
    all_special_ids = [1]

    def __init__(self):
        self.calls = []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append((list(ids), skip_special_tokens))
        return "".join("a\nb" if i == 10 else f"<{i}>" for i in ids)

    def convert_ids_to_tokens(self, i):
        return f"TOKEN{i}"


def pieces(text: Text) -> list[tuple[str, str]]:
    """(text, style) of each appended piece, in order."""
    return [(text.plain[s.start:s.end], str(s.style)) for s in text.spans]


def ev(seq=0, canvas=(5, 6, MASK, MASK, MASK), prompt_len=2, filled=(), edited=(), forward=0, finished=False,
       kind="m2t", **extra):
    return SimpleNamespace(seq=seq, canvas=list(canvas), prompt_len=prompt_len, filled=list(filled),
                           edited=list(edited), forward=forward, finished=finished, kind=kind, **extra)


def test_piece():
    v = CanvasView(Tok(), MASK)
    assert v.piece(MASK) == "\u2591"
    assert v.piece(7) == "<7>"
    assert v.piece(1) == "TOKEN1"  # special ids show their token name
    assert v.piece(10) == "a\u23ce\nb"  # newlines visible
    plain = CanvasView(None, MASK)
    assert plain.piece(7) == "[7]" and plain.piece(MASK) == "\u2591"


def test_init():
    tok, con = Tok(), Console(file=io.StringIO())
    v = CanvasView(tok, MASK, console=con, delay=0.5)
    assert (v.tok, v.mask_id, v.delay, v.console, v.state, v.live) == (tok, MASK, 0.5, con, {}, None)
    assert isinstance(CanvasView(tok, MASK).console, Console) and CanvasView(tok, MASK).delay == 0.0


def test_render_colours_and_underlines():
    v = CanvasView(Tok(), MASK)
    v.update(ev(canvas=[5, 6, 7, MASK, MASK, MASK], filled=[2], forward=0))
    v.update(ev(canvas=[5, 6, 8, 9, MASK, 10], filled=[3, 5], edited=[2], forward=1, kind="t2t"))
    v.update(ev(seq=3, canvas=[4, 1, MASK], prompt_len=1, forward=4, finished=True, kind="post"))
    st = v.state[0]
    assert st["events"] == 2 and st["forward"] == 2 and st["step"] == "t2t" and st["finished"] is False
    assert st["last"] == {2, 3, 5} and st["kind"] == {2: "edit", 3: "draft", 5: "draft"}
    assert st["prompt_len"] == 2 and st["canvas"] == [5, 6, 8, 9, MASK, 10] and st["lev"] == []
    group = v.render()
    items = list(group.renderables)
    assert len(items) == 7  # (head, body, blank) per sequence, sorted by seq, then the legend
    head0, body0, blank0, head3, body3, blank3, legend = items
    assert head0.plain == "sequence 0  forwards 2  last step: t2t\n" and str(head0.style) == "bold"
    assert head3.plain == "sequence 3  forwards 5  last step: post  (done)\n"
    assert blank0.plain == "" and blank3.plain == ""
    u = " underline"
    assert pieces(body0) == [("<5>", STYLES["prompt"]), ("<6>", STYLES["prompt"]), ("<8>", STYLES["edit"] + u),
                             ("<9>", STYLES["draft"] + u), ("\u2591", STYLES["mask"]),
                             ("a\u23ce\nb", STYLES["draft"] + u)]
    # a prompt token among the last forward's positions is underlined too; unseen positions count as drafted
    assert pieces(body3) == [("<4>", STYLES["prompt"]), ("TOKEN1", STYLES["draft"]), ("\u2591", STYLES["mask"])]
    assert pieces(legend) == [("prompt ", STYLES["prompt"]), ("\u2591 mask ", STYLES["mask"]),
                              ("drafted ", STYLES["draft"]), ("edited\n", STYLES["edit"])]


def test_prompt_positions_stay_dim_and_underlined():
    v = CanvasView(Tok(), MASK)
    v.update(ev(canvas=[5, 6, 7], prompt_len=2, edited=[1], filled=[2]))
    body = list(v.render().renderables)[1]
    assert pieces(body) == [("<5>", "dim"), ("<6>", "dim underline"), ("<7>", "green underline")]


def test_levenshtein_list_and_shifted_colours():
    v = CanvasView(Tok(), MASK)
    v.update(ev(canvas=[5, 6, 7, 8, 9, 11, 12], prompt_len=2, filled=[2, 3, 4, 5], forward=0))
    v.update(ev(canvas=[5, 6, 7, 8, 9, 11, 12], prompt_len=2, edited=[6], forward=1))
    assert v.state[0]["kind"] == {2: "draft", 3: "draft", 4: "draft", 5: "draft", 6: "edit"}
    # a DELETE at 4 and an INSERT at 5: colours from position 4 on no longer hold, except those just written
    v.update(ev(canvas=[5, 6, 7, 8, 9, MASK, 12], prompt_len=2, filled=[6], edited=[], forward=2,
                deleted=[4], inserted=[5]))
    st = v.state[0]
    assert st["kind"] == {2: "draft", 3: "draft", 6: "draft"}
    assert st["lev"] == ["f2: del @2", "f2: ins @3"]
    assert st["last"] == {6}
    items = list(v.render().renderables)
    assert len(items) == 5
    lev = items[2]
    assert lev.plain == "levenshtein: f2: del @2, f2: ins @3" and str(lev.style) == STYLES["lev"]
    assert items[3].plain == ""  # the blank line stays after the list
    # an edit in the same event keeps its colour; the list keeps the last eight operations
    for f in range(3, 8):
        v.update(ev(canvas=[5, 6, 7, 8, 9, 10, 12], prompt_len=2, edited=[5], forward=f, deleted=[3], inserted=[6]))
    st = v.state[0]
    assert st["kind"] == {2: "draft", 5: "edit"}
    want = ["f2: del @2", "f2: ins @3"] + [x for f in range(3, 8) for x in (f"f{f}: del @1", f"f{f}: ins @4")]
    assert st["lev"] == want[-8:]
    # events without operations leave the list and the colours alone
    v.update(ev(canvas=[5, 6, 7, 8, 9, 10, 12], prompt_len=2, filled=[3], forward=8))
    assert st["lev"] == want[-8:] and st["kind"] == {2: "draft", 3: "draft", 5: "edit"}
    v.update(ev(canvas=[5, 6, 7, 8, 9, 10, 12], prompt_len=2, forward=9, deleted=[], inserted=[]))
    assert st["lev"] == want[-8:] and st["kind"] == {2: "draft", 3: "draft", 5: "edit"}


def test_live_view_redraws_and_waits(monkeypatch):
    out = io.StringIO()
    con = Console(file=out, width=120, color_system=None)
    slept = []
    monkeypatch.setattr(show.time, "sleep", slept.append)
    v = CanvasView(Tok(), MASK, console=con, delay=0.25)
    v.update(ev(forward=0))  # before entering: no live display, no wait
    assert slept == []
    with v as entered:
        assert entered is v and v.live is not None
        assert v.live.console is con and v.live.transient is False
        seen = []
        monkeypatch.setattr(v.live, "update", lambda r, **kw: seen.append(r))
        v.update(ev(filled=[2], forward=1))
        assert slept == [0.25] and len(seen) == 1
        assert list(seen[0].renderables)[0].plain == "sequence 0  forwards 2  last step: m2t\n"
        monkeypatch.undo()
        monkeypatch.setattr(show.time, "sleep", slept.append)
    assert "sequence 0  forwards 2" in out.getvalue()  # the final frame is drawn on exit
    v2 = CanvasView(Tok(), MASK, console=Console(file=io.StringIO()))
    with v2:
        v2.update(ev())
    assert slept == [0.25]  # delay 0: no wait


def test_live_refresh_rate():
    v = CanvasView(Tok(), MASK, console=Console(file=io.StringIO()))
    with v:
        assert v.live.refresh_per_second == 20


def traj(**kw):
    t = {"stop": "done", "prompt_ids": [3, 4], "env_reward": 0.5, "turns": [
        {"index": 0, "forwards": 7, "finished_by": "eos", "text": "a<tool_call>x</tool_call>b<tool_call>y\n</tool_call>",
         "tool_calls": [{"name": "calc", "arguments": {"e": "1"}, "ok": True, "result": "R" * 250, "latency_s": 0.01234},
                        {"name": "bad", "arguments": {}, "ok": False, "result": "boom"}],
         "observation": "obs0"},
        {"index": 1, "forwards": 2, "finished_by": "budget", "text": "plain", "tool_calls": [], "observation": "O" * 300},
        {"index": 2, "forwards": 1, "finished_by": "eos", "text": "x", "tool_calls": [], "observation": None,
         "error": "env crashed"},
        {"index": 3, "forwards": 1, "finished_by": "eos", "text": "", "tool_calls": [], "observation": None},
    ]}
    t.update(kw)
    return t


def test_render_trajectory_header():
    tok = Tok()
    head, body = render_trajectory(traj(), tok).renderables
    assert head.plain == "stop: done  turns 4  tool calls 2  env reward 0.5\n" and str(head.style) == "bold"
    head, _ = render_trajectory(traj(failed=True, error="boom", env_reward=1.0), tok).renderables
    assert head.plain == "stop: done (FAILED: boom)  turns 4  tool calls 2  env reward 1\n"
    t = traj(failed=False, error="ignored")
    del t["env_reward"]
    head, _ = render_trajectory(t, tok).renderables
    assert head.plain == "stop: done  turns 4  tool calls 2  env reward 0\n"
    assert tok.calls[-1] == ([3, 4], False)  # the prompt keeps its special tokens


def test_render_trajectory_body():
    _, body = render_trajectory(traj(), Tok()).renderables
    got = pieces(body)
    call = f"  -> calc({{'e': '1'}}) = {'R' * 200} [0.012 s]\n"
    assert str(body.style) == TURN_STYLES["prompt"]  # the prompt: the text's base style
    want = [("[turn 1, 7 forwards, ended by eos] ", "bold"), ("a", TURN_STYLES["model"]),
            ("<tool_call>x</tool_call>", TURN_STYLES["call"]), ("b", TURN_STYLES["model"]),
            ("<tool_call>y\n</tool_call>", TURN_STYLES["call"]), ("\n", TURN_STYLES["model"]),
            (call, TURN_STYLES["obs"]), ("  -> bad({}) = boom [0.000 s]\n", TURN_STYLES["error"]),
            ("[turn 2, 2 forwards, ended by budget] ", "bold"), ("plain\n", TURN_STYLES["model"]),
            (f"  <- {'O' * 200}\n", TURN_STYLES["obs"]),
            ("[turn 3, 1 forwards, ended by eos] ", "bold"), ("x\n", TURN_STYLES["model"]),
            ("  environment failed: env crashed\n", TURN_STYLES["error"]),
            ("[turn 4, 1 forwards, ended by eos] ", "bold"), ("\n", TURN_STYLES["model"])]
    assert got == want
    assert body.plain == "<3><4>\n" + "".join(p for p, _ in want)


@pytest.mark.parametrize("ok", [None, False])
def test_failed_call_is_red(ok):
    t = traj(turns=[{"index": 0, "forwards": 1, "finished_by": "eos", "text": "t",
                     "tool_calls": [{"name": "n", "arguments": 1, "ok": ok, "result": None, "latency_s": 2.0}]}])
    _, body = render_trajectory(t, Tok()).renderables
    assert pieces(body)[-1] == ("  -> n(1) = None [2.000 s]\n", TURN_STYLES["error"])


@pytest.mark.parametrize("which", ["deleted", "inserted"])
def test_one_kind_of_operation_alone(which):
    """An event with only DELETEs (or only INSERTs), and an event that has no field for the other kind."""
    word = {"deleted": "del", "inserted": "ins"}[which]
    for extra in ({which: [4], ("inserted" if which == "deleted" else "deleted"): []}, {which: [4]}):
        v = CanvasView(Tok(), MASK)
        v.update(ev(canvas=[5, 6, 7, 8, 9, 11], prompt_len=2, filled=[2, 3, 4, 5], forward=0))
        v.update(ev(canvas=[5, 6, 7, 8, 9, 11], prompt_len=2, forward=1, **extra))
        assert v.state[0]["lev"] == [f"f1: {word} @2"]
        assert v.state[0]["kind"] == {2: "draft", 3: "draft"}


def test_live_starts_empty():
    v = CanvasView(Tok(), MASK, console=Console(file=io.StringIO()))
    with v:
        first = v.live.get_renderable()
        assert str(first) == ""
