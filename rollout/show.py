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
