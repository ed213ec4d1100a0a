"""Dataset rows and token batches for CPT, SFT, RL and evaluation.

* `load_rows(source)`: `.jsonl`, `.json` (a list of objects), `.parquet`, or `hf:PATH[:split]` (a dataset
  saved with `datasets.save_to_disk`; nothing is downloaded). A list of sources is concatenated. Malformed
  rows raise `DataError` naming the file and line.
* `encode_prompt` / `encode_sft`: chat-templated prompt ids and the response ids ending with EOS.
* `filter_overlong_prompts`: drop (or refuse) rows whose prompt exceeds the token limit, with a count.
* `pack_documents`: CPT documents joined with EOS and cut into fixed-length chunks.
* `collate`: right-pad a list of examples to a whole number of blocks and mark the response positions.
* `EpochSampler`: seeded epoch shuffling with a resumable state.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch


class DataError(ValueError):
    """A data file or row is invalid; the message names the file (and line)."""


def load_rows(source: str | Path | list, required: tuple[str, ...] = ()) -> list[dict]:
    """All rows (dicts) of one source or a list of sources; `required` fields must be present in each row."""
    if isinstance(source, (list, tuple)):
        rows = []
        for s in source:
            rows += load_rows(s, required)
        return rows
    source = str(source)
    if source.startswith("hf:"):
        rows, name = _load_hf(source[3:]), source
        lines = None
    elif source.startswith(("rg:", "vf:")):  # reasoning-gym / verifiers datasets (ebpo.infra.task_libraries)
        from ebpo.infra.task_libraries import TaskLibraryError, load_rg, load_vf

        try:
            rows, name, lines = (load_rg if source.startswith("rg:") else load_vf)(source), source, None
        except TaskLibraryError as e:
            raise DataError(str(e)) from None
    else:
        path = Path(source)
        if not path.exists():
            raise DataError(f"data file {source!r} does not exist")
        name = str(path)
        if path.suffix == ".jsonl":
            rows, lines = _load_jsonl(path)
        elif path.suffix == ".json":
            try:
                rows = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
            if not isinstance(rows, list):
                raise DataError(f"{path}: a .json data file must hold a list of objects")
            lines = None
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq

            rows, lines = pq.read_table(path).to_pylist(), None
        else:
            raise DataError(f"{path}: unsupported data format {path.suffix!r}; use .jsonl, .json, .parquet or hf:PATH")
    for i, row in enumerate(rows):
        where = f"{name}:{lines[i]}" if lines else f"{name} row {i}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object, got {type(row).__name__}")
        missing = [f for f in required if f not in row]
        if missing:
            raise DataError(f"{where}: missing field {missing[0]!r} (fields present: {sorted(row)})")
    if not rows:
        raise DataError(f"{name}: no rows")
    return rows


def _load_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    rows, lines = [], []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line.rstrip("\r\n")))  # columns of the line as an editor shows it
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: invalid JSON: {e.msg} (column {e.colno})") from None
            lines.append(n)
    return rows, lines


def _load_hf(spec: str) -> list[dict]:
    path, _, split = spec.partition(":")
    if not Path(path).exists():
        raise DataError(f"hf:{spec}: {path!r} is not a local dataset folder (datasets.save_to_disk); "
                        "hub downloads are not supported")
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        split = split or "train"
        if split not in ds:
            raise DataError(f"hf:{spec}: no split {split!r}; splits: {list(ds)}")
        ds = ds[split]
    return [dict(r) for r in ds]


def _text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tool_specs(env) -> list[dict] | None:
    """The tool specs of an environment (`env.specs`, the JSON-schema list a `rewards.envs.ToolEnv` has), or None
    for an environment without tools: what `apply_chat_template(..., tools=...)` renders into a prompt."""
    specs = getattr(env, "specs", None)
    return list(specs) if specs else None


def encode_prompt(tokenizer, text: str, chat_template: bool = True, max_tokens: int | None = None,
                  tools: list[dict] | None = None) -> list[int]:
    """Prompt token ids (chat-templated with the generation prompt when `chat_template`); cut from the left.

    tools: the environment's tool specs (`tool_specs`), rendered by the chat template's `tools=` argument as a
    chat model expects them (multi-turn prompts); None = no tools (the prompt is what it always was)."""
    if chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tools=tools or None,
                                             add_generation_prompt=True, tokenize=False)
    ids = _text_ids(tokenizer, text)
    return ids[-max_tokens:] if max_tokens else ids


def filter_overlong_prompts(rows: list[dict], prompt_length, max_tokens: int, mode: str = "filter",
                            source: str = "data") -> tuple[list[dict], int]:
    """Drop (mode "filter") or refuse (mode "error") rows whose prompt is longer than `max_tokens` tokens.

    prompt_length(row) -> int is the prompt's length as the model will see it (chat template included).
    Cutting a prompt instead would drop its chat header or the start of the question without a trace.
    Returns (kept rows, number dropped); "error" raises DataError naming `source`, the row and the lengths.
    Filtering every row is an error too (nothing left to train on).
    """
    if mode not in ("filter", "error"):
        raise ValueError(f"overlong_prompts: choose filter or error, got {mode!r}")
    kept, dropped = [], 0
    for i, row in enumerate(rows):
        n = int(prompt_length(row))
        if n <= max_tokens:
            kept.append(row)
            continue
        if mode == "error":
            raise DataError(f"{source} row {i}: the prompt has {n} tokens, more than data.max_prompt_tokens = "
                            f"{max_tokens}; raise data.max_prompt_tokens or set data.overlong_prompts=filter")
        dropped += 1
    if rows and not kept:
        raise DataError(f"{source}: all {len(rows)} prompts are longer than data.max_prompt_tokens = {max_tokens}")
    return kept, dropped


def encode_sft(tokenizer, prompt: str, response: str, *, chat_template: bool = True, max_len: int = 512,
               max_prompt_tokens: int | None = None) -> tuple[list[int], int]:
    """(prompt + response + EOS ids, prompt length). Over `max_len`, the response is cut at the right
    (then it has no EOS: the model is not taught to stop early) after the prompt is cut from the left."""
    eos = tokenizer.eos_token_id
    p = encode_prompt(tokenizer, prompt, chat_template, max_prompt_tokens)
    if len(p) >= max_len:
        p = p[-(max_len // 2):]
    r = _text_ids(tokenizer, response) + [eos]
    ids = (p + r)[:max_len]
    return ids, len(p)


def pack_documents(tokenizer, texts: list[str], seq_len: int) -> list[list[int]]:
    """CPT packing: documents joined with EOS after each, cut into chunks of exactly `seq_len` tokens.

    The tail shorter than `seq_len` is dropped (when there is at least one full chunk).
    """
    stream: list[int] = []
    for t in texts:
        stream += _text_ids(tokenizer, t) + [tokenizer.eos_token_id]
    chunks = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)]
    if len(chunks) > 1 and len(chunks[-1]) < seq_len:
        chunks.pop()
    return chunks


def collate(examples: list[tuple[list[int], int | list[bool]]], block_size: int, pad_id: int, *,
            eos_id: int | None = None, mask_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (ids, prompt_len) examples to a common length that is a multiple of `block_size`.

    A multi-turn example gives its loss mask instead of a prompt length: (ids, mask) with mask a list of
    bools as long as ids (`ebpo.sft.multiturn.encode_messages`); it is used as it is (the layout already
    ends every turn on a block boundary).

    Returns input_ids (B, L) long and response_mask (B, L) bool. The last block of an example is scored
    whole (docs/ebpo.md, "The last block"; the RL learner does the same with the sampler's canvas): the
    response region runs from its prompt end to the end of the block holding its last token, and the EOS
    padding inside that block is part of the target (so the model learns to fill a finished block with
    EOS); later padding blocks are not. An example cut at max_len (its last token is not `eos_id`) has no real tokens
    after the cut: with `eos_id` and `mask_id` given, the rest of its last block holds the mask token
    (not yet decoded) and is not scored, instead of teaching EOS right after the cut.
    """
    L = max(len(ids) for ids, _ in examples)
    L = -(-L // block_size) * block_size
    B = len(examples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    response = torch.zeros((B, L), dtype=torch.bool)
    for i, (ids, plen) in enumerate(examples):
        input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        if isinstance(plen, (list, tuple)):  # multi-turn: an explicit loss mask
            response[i, :len(plen)] = torch.tensor(plen, dtype=torch.bool)
            continue
        end = -(-len(ids) // block_size) * block_size
        if eos_id is not None and mask_id is not None and ids and ids[-1] != eos_id:  # cut: hide the tail
            input_ids[i, len(ids):end] = mask_id
            end = len(ids)
        response[i, plen:end] = True
    return input_ids, response


class EpochSampler:
    """Indices 0..n-1 in a seeded order, reshuffled every epoch; `state()` / `restore()` for resume."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        if n <= 0:
            raise DataError("cannot sample from an empty dataset")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        """The next k indices (crossing epoch boundaries)."""
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(k - len(out), self.n - self.pos)
            out += self._order[self.pos:self.pos + take]
            self.pos += take
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def restore(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order()


def reference_ids(tokenizer, row: dict) -> list[int] | None:
    """The row's correct completion as token ids ending with EOS (as SFT trains on it), None without `response`."""
    if not row.get("response"):
        return None
    return tokenizer(str(row["response"]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
