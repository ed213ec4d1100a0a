"""Prompts of an RL run: the resumable sampler over the training rows, prompt encoding, the reward's view of a
sample, and the seeds derived from `trainer.seed` (no global RNG anywhere in the driver).
"""
from __future__ import annotations

import logging
import random
from typing import Optional

from ebpo.infra.data import filter_overlong_prompts, load_rows
from ebpo.rl.config import DataConfig
from ebpo.rl.records import RolloutSample

log = logging.getLogger("ebpo")


def derive_seed(*parts: int) -> int:
    """Deterministic 63-bit seed from integers (step, sample index, ...): no global RNG involved."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


class PromptSampler:
    """Epoch-wise shuffled, resumable stream of training rows; its state is (epoch, position)."""

    def __init__(self, rows: list[dict], seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("data.train: the training set is empty")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(derive_seed(self.seed, self.epoch)).shuffle(order)
        return order

    def next(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._make_order()
            out.append(self.rows[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._make_order()


class Prompts:
    """Encodes and loads prompt rows as `data` says (prompt field, chat template, length limit).

    tools: the environment's tool specs (multi-turn RL, `ebpo.infra.data.tool_specs`), rendered into every prompt
    by the chat template's `tools=` argument (`ebpo.sft.multiturn.encode_messages` takes the same); None = none."""

    def __init__(self, data: DataConfig, tokenizer, tools: list[dict] | None = None):
        self.data, self.tokenizer, self.tools = data, tokenizer, tools or None
        self.metrics: dict[str, float] = {}  # over-long prompts dropped at load time (data/overlong_*_prompts)

    def encode(self, row: dict) -> list[int]:
        """Token ids of the row's prompt (chat template, with the tools, applied when `data.chat_template`)."""
        text = row[self.data.prompt_field]
        if self.data.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tools=self.tools,
                                                      add_generation_prompt=True, tokenize=False)
        # never cut: rows with longer prompts were filtered (or refused) at load time, `load`
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def load(self, source, split: str) -> list[dict]:
        """Rows of `source` whose prompt fits data.max_prompt_tokens (data.overlong_prompts: filter | error)."""
        d = self.data
        rows, dropped = filter_overlong_prompts(load_rows(source), lambda r: len(self.encode(r)),
                                                d.max_prompt_tokens, d.overlong_prompts, f"data.{split}")
        self.metrics[f"data/overlong_{split}_prompts"] = float(dropped)
        if dropped:
            log.warning(f"data.{split}: dropped {dropped} of {len(rows) + dropped} rows whose prompt is longer than "
                        f"data.max_prompt_tokens = {d.max_prompt_tokens} tokens (data.overlong_prompts=filter)")
        return rows


def reward_input(row: dict, completion: str, prompt_field: str, sample: Optional[RolloutSample] = None) -> dict:
    """What a reward function sees of one sample: prompt, completion, answer, tests, and the row's other
    fields as metadata (with the rollout's decode trace when `sample` is given, for rewards on decoding
    cost, rewards/decode_cost.py). A multi-turn sample adds its `trajectory` (rewards/trajectory.py)."""
    meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "tests", "response")}
    if sample is not None:
        meta["decode"] = {"forwards": sample.num_forwards, "tokens": len(sample.token_ids)}
    out = {"prompt": row[prompt_field], "completion": completion, "answer": row.get("answer"),
           "tests": row.get("tests"), "metadata": meta}
    if sample is not None and sample.trajectory is not None:
        out["trajectory"] = sample.trajectory
    return out
