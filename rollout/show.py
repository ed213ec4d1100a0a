"""A live terminal view of draft-and-edit decoding (`ebpo generate --show`).

Each sequence's canvas is drawn as it fills: the prompt dim, masks as grey blocks, tokens drafted by
M2T in green, tokens rewritten by T2T / MBE in yellow, and the positions touched by the latest forward
underlined. Levenshtein operations (DecodeConfig.tau_delete / tau_insert) are listed under the sequence:
each DELETE / INSERT with its position, and slots opened by INSERT show as masks until filled.
Feed it `StepEvent`s through `generate(..., on_step=view.update)`.
"""
from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

STYLES = {"prompt": "dim", "mask": "grey35", "draft": "green", "edit": "bold yellow", "lev": "magenta"}


class CanvasView:
    """Renders one canvas per sequence; `update(event)` redraws after every forward."""

    def __init__(self, tokenizer, mask_id: int, console: Console | None = None, delay: float = 0.0):
        self.tok, self.mask_id, self.delay = tokenizer, mask_id, delay
        self.console = console or Console()
        self.state: dict[int, dict] = {}
        self.live: Live | None = None

    def __enter__(self):
        self.live = Live(Text(""), console=self.console, refresh_per_second=20, transient=False)
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        self.live.update(self.render())
        self.live.__exit__(*exc)

    def piece(self, token_id: int) -> str:
        """Printable text of one token (masks as a block glyph, newlines visible)."""
        if token_id == self.mask_id:
            return "\u2591"
        s = self.tok.decode([token_id]) if self.tok is not None else f"[{token_id}]"
        if token_id in set(self.tok.all_special_ids if self.tok is not None else []):
            s = self.tok.convert_ids_to_tokens(token_id)
        return s.replace("\n", "\u23ce\n")

    def update(self, ev) -> None:
        st = self.state.setdefault(ev.seq, {"kind": {}, "events": 0, "lev": []})
        st.update(canvas=ev.canvas, prompt_len=ev.prompt_len, last=set(ev.filled) | set(ev.edited),
                  forward=ev.forward + 1, finished=ev.finished, step=ev.kind)
        st["events"] += 1
        for p in ev.filled:
            st["kind"][p] = "draft"
        for p in ev.edited:
            st["kind"][p] = "edit"
        deleted, inserted = getattr(ev, "deleted", []), getattr(ev, "inserted", [])
        if deleted or inserted:
            # a shift moves the tokens after the operation: their colours no longer describe them
            lo = min(deleted + inserted)
            st["kind"] = {p: k for p, k in st["kind"].items() if p < lo or p in ev.filled or p in ev.edited}
            st["lev"] = (st["lev"] + [f"f{ev.forward}: del @{p - ev.prompt_len}" for p in deleted]
                         + [f"f{ev.forward}: ins @{p - ev.prompt_len}" for p in inserted])[-8:]
        if self.live is not None:
            self.live.update(self.render())
            if self.delay:
                time.sleep(self.delay)

    def render(self) -> Group:
        parts = []
        for seq in sorted(self.state):
            st = self.state[seq]
            head = Text(f"sequence {seq}  forwards {st['forward']}  last step: {st['step']}"
                        f"{'  (done)' if st['finished'] else ''}\n", style="bold")
            body = Text()
            for p, t in enumerate(st["canvas"]):
                if p < st["prompt_len"]:
                    style = STYLES["prompt"]
                elif t == self.mask_id:
                    style = STYLES["mask"]
                else:
                    style = STYLES[st["kind"].get(p, "draft")]
                if p in st["last"]:
                    style += " underline"
                body.append(self.piece(t), style=style)
            parts += [head, body, Text("")]
            if st.get("lev"):
                parts.insert(len(parts) - 1, Text("levenshtein: " + ", ".join(st["lev"]), style=STYLES["lev"]))
        legend = Text.assemble(("prompt ", STYLES["prompt"]), ("\u2591 mask ", STYLES["mask"]),
                               ("drafted ", STYLES["draft"]), ("edited\n", STYLES["edit"]))
        return Group(*parts, legend)


TURN_STYLES = {"prompt": "dim", "model": "green", "call": "bold cyan", "obs": "yellow", "error": "bold red",
               "filler": "grey35"}


def render_trajectory(traj: dict, tokenizer) -> Group:
    """A multi-turn trajectory (`Trajectory.to_dict()`) as text: the prompt dim, each model turn green with
    its tool calls cyan, each tool call's result (or error, red), the environment's observation yellow, and
    a header line with the stop reason, turns, tool calls and reward (`ebpo generate --env ... --show`)."""
    import re

    head = Text(f"stop: {traj['stop']}{' (FAILED: ' + str(traj.get('error')) + ')' if traj.get('failed') else ''}"
                f"  turns {len(traj['turns'])}  tool calls {sum(len(t['tool_calls']) for t in traj['turns'])}"
                f"  env reward {traj.get('env_reward', 0.0):g}\n", style="bold")
    body = Text(tokenizer.decode(traj["prompt_ids"], skip_special_tokens=False), style=TURN_STYLES["prompt"])
    body.append("\n")
    for t in traj["turns"]:
        body.append(f"[turn {t['index'] + 1}, {t['forwards']} forwards, ended by {t['finished_by']}] ", style="bold")
        pos = 0
        for m in re.finditer(r"<tool_call>.*?</tool_call>", t["text"], re.S):
            body.append(t["text"][pos:m.start()], style=TURN_STYLES["model"])
            body.append(m.group(0), style=TURN_STYLES["call"])
            pos = m.end()
        body.append(t["text"][pos:] + "\n", style=TURN_STYLES["model"])
        for c in t["tool_calls"]:
            ok = c.get("ok")
            body.append(f"  -> {c.get('name')}({c.get('arguments')}) = {c.get('result')!s:.200}"
                        f" [{c.get('latency_s', 0.0):.3f} s]\n", style=TURN_STYLES["obs" if ok else "error"])
        if t.get("error"):
            body.append(f"  environment failed: {t['error']}\n", style=TURN_STYLES["error"])
        elif t.get("observation") is not None and not t["tool_calls"]:
            body.append(f"  <- {t['observation']!s:.200}\n", style=TURN_STYLES["obs"])
    return Group(head, body)
