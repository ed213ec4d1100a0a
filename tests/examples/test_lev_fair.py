"""The fair Levenshtein test's task (examples/tasks/lev_fair.py): the generator, the shift classifier against a
breadth-first search over edit scripts, and its rewards (examples/rewards/lev_fair.py) loaded as a recipe would."""
import itertools
import json
import sys
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.tasks import lev_fair  # noqa: E402
from rewards.loader import load_reward  # noqa: E402


def bfs_distance(a: str, b: str, alphabet: str) -> int:
    """Fewest single-letter insertions, deletions and substitutions from a to b, by breadth-first search over all
    strings (no table): the plain definition the classifier's distance must agree with."""
    seen, todo = {a}, deque([(a, 0)])
    limit = max(len(a), len(b)) + 1
    while todo:
        s, d = todo.popleft()
        if s == b:
            return d
        nxt = [s[:i] + s[i + 1:] for i in range(len(s))]
        nxt += [s[:i] + c + s[i:] for i in range(len(s) + 1) for c in alphabet if len(s) < limit]
        nxt += [s[:i] + c + s[i + 1:] for i in range(len(s)) for c in alphabet]
        for t in nxt:
            if t not in seen:
                seen.add(t)
                todo.append((t, d + 1))
    raise AssertionError("unreachable")


def reference_kind(out: str, ref: str, alphabet: str) -> str:
    """Shift = some insertion or deletion makes the edit strictly cheaper than substitutions alone (which cannot
    change the length, so unequal lengths are always shifts)."""
    if out == ref:
        return "correct"
    subs_only = sum(x != y for x, y in zip(out, ref)) if len(out) == len(ref) else float("inf")
    return "shift" if bfs_distance(out, ref, alphabet) < subs_only else "substitution"


def all_strings(alphabet: str, max_len: int):
    for n in range(max_len + 1):
        yield from ("".join(p) for p in itertools.product(alphabet, repeat=n))


def test_error_kind_and_distance_match_breadth_first_search_on_every_small_pair():
    alphabet = "ab"
    strings = list(all_strings(alphabet, 4)) + ["abab" + "b", "babab"]
    kinds = {"correct": 0, "shift": 0, "substitution": 0}
    for out, ref in itertools.product(strings, repeat=2):
        want = reference_kind(out, ref, alphabet)
        assert lev_fair.error_kind(out, ref) == want, (out, ref)
        assert lev_fair.edit_distance(out, ref) == bfs_distance(out, ref, alphabet), (out, ref)
        kinds[want] += 1
    assert all(v > 0 for v in kinds.values())  # every class is exercised


def test_error_kind_on_the_errors_the_test_is_about():
    ref = "abcdefghijkl"
    assert lev_fair.error_kind("abcdeffghijk", ref) == "shift"  # a repeated letter, the last one pushed out
    assert lev_fair.error_kind("abcdeghijklm", ref) == "shift"  # a dropped letter, same length
    assert lev_fair.error_kind("abcdefghijk", ref) == "shift"  # a dropped last letter
    assert lev_fair.error_kind("abcdxfghijkl", ref) == "substitution"
    assert lev_fair.error_kind("bacdefghijkl", ref) == "substitution"  # a swap costs 2 either way


def test_generator_is_deterministic_disjoint_and_well_formed(tmp_path):
    train, held = lev_fair.make_splits(300, 50, seed=3)
    again = lev_fair.make_splits(300, 50, seed=3)
    assert (train, held) == again
    assert lev_fair.make_splits(300, 50, seed=4) != (train, held)
    held_prompts = [r["prompt"] for r in held]
    assert len(set(held_prompts)) == len(held)
    assert not set(held_prompts) & {r["prompt"] for r in train}
    for r in train + held:
        kind, s = r["prompt"].split(": ")
        assert 12 <= len(s) <= 40 and set(s) <= set(lev_fair.ALPHABET)
        assert r["answer"] == r["response"] == (s if kind == "Copy" else s[::-1]) and kind in lev_fair.KINDS
        assert r["task"] == "lev_fair"
    assert {r["prompt"].split(":")[0] for r in train} == set(lev_fair.KINDS)
    assert {len(r["answer"]) for r in train} == set(range(12, 41))


def test_held_out_prompts_never_occur_in_training_even_when_strings_collide(monkeypatch):
    monkeypatch.setattr(lev_fair, "ALPHABET", "ab")
    train, held = lev_fair.make_splits(200, 5, seed=0, min_len=2, max_len=3)  # 24 possible prompts
    assert len({r["prompt"] for r in held}) == 5
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    assert len({r["prompt"] for r in train}) > 1


def test_shipped_files_are_the_generators_output():
    train, held = lev_fair.make_splits(10000, 500, seed=0)
    for name, rows in (("lev_fair_train", train), ("lev_fair_eval", held)):
        text = (ROOT / "examples/data" / f"{name}.jsonl").read_text()
        assert text == "".join(json.dumps(r) + "\n" for r in rows)


def test_copy_task_files_are_the_generators_output_and_never_hold_a_training_prompt():
    """The task run (copy only): generated with the earlier mixed training split excluded from its held-out rows,
    since the start model met that split's copy rows in training."""
    old_train = {json.loads(line)["prompt"] for line in (ROOT / "examples/data/lev_fair_train.jsonl").open()}
    train, held = lev_fair.make_splits(10000, 500, seed=0, kinds=("Copy",), exclude=frozenset(old_train))
    for name, rows in (("lev_fair_copy_train", train), ("lev_fair_copy_eval", held)):
        text = (ROOT / "examples/data" / f"{name}.jsonl").read_text()
        assert text == "".join(json.dumps(r) + "\n" for r in rows)
    held_prompts = {r["prompt"] for r in held}
    assert len(held_prompts) == 500 and not held_prompts & (old_train | {r["prompt"] for r in train})
    assert all(r["prompt"] == "Copy: " + r["answer"] for r in train + held)


def _squeeze(s: str) -> str:
    """Every run of a repeated letter squeezed to one, by a plain loop (the task's rule)."""
    out = ""
    for c in s:
        if not out or out[-1] != c:
            out += c
    return out


def test_squeeze_rows_follow_the_rule_and_the_shipped_files_are_the_generators_output():
    old_train = {json.loads(line)["prompt"] for line in (ROOT / "examples/data/lev_fair_train.jsonl").open()}
    train, held = lev_fair.make_splits(10000, 500, seed=0, min_len=12, max_len=32, kinds=("Squeeze",),
                                       exclude=frozenset(old_train))
    for name, rows in (("lev_fair_squeeze_train", train), ("lev_fair_squeeze_eval", held)):
        assert (ROOT / "examples/data" / f"{name}.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in rows)
    runs = []
    for r in train + held:
        kind, src = r["prompt"].split(": ")
        assert kind == "Squeeze" and r["answer"] == r["response"] == _squeeze(src)
        assert 12 <= len(r["answer"]) <= 32 and set(src) <= set(lev_fair.ALPHABET)
        i = 0
        while i < len(src):  # every run is 1 or 2 letters long
            j = i
            while j < len(src) and src[j] == src[i]:
                j += 1
            runs.append(j - i)
            i = j
    assert set(runs) == {1, 2} and 0.4 < runs.count(2) / len(runs) < 0.6  # doubled with probability 1/2
    assert not {r["prompt"] for r in held} & ({r["prompt"] for r in train} | old_train)


def test_squeeze_is_not_mixed_with_other_kinds():
    with pytest.raises(ValueError, match="Squeeze"):
        lev_fair.make_splits(3, 1, kinds=("Copy", "Squeeze"))


def test_excluded_prompts_never_become_held_out(monkeypatch):
    monkeypatch.setattr(lev_fair, "ALPHABET", "ab")
    two = {f"Copy: {a}{b}" for a in "ab" for b in "ab"}
    three = {f"Copy: {a}{b}{c}" for a in "ab" for b in "ab" for c in "ab"}
    exclude = frozenset(sorted(two)[:3] + sorted(three)[:4])  # 5 of the 12 copy prompts left to draw
    train, held = lev_fair.make_splits(30, 4, seed=0, min_len=2, max_len=3, kinds=("Copy",), exclude=exclude)
    held_prompts = {r["prompt"] for r in held}
    assert len(held_prompts) == 4 and held_prompts <= (two | three) - exclude
    assert {r["prompt"] for r in train} == (two | three) - exclude - held_prompts  # the one prompt left


@pytest.fixture(scope="module")
def rewards():
    path = ROOT / "examples/rewards/lev_fair.py"
    return load_reward(f"{path}:exact_answer"), load_reward(f"{path}:similarity")


def test_rewards(rewards):
    exact, sim = rewards
    score = lambda fn, c, a: fn(prompt="p", completion=c, answer=a)  # noqa: E731
    assert score(exact, " abcdef\n", "abcdef") == 1.0 and score(exact, "abcdeff", "abcdef") == 0.0
    assert score(sim, "abcdef", "abcdef") == 1.0
    # one dropped letter costs one letter's share (2 * 5 / 11), not every letter after it
    assert score(sim, "abdef", "abcdef") == pytest.approx(10 / 11, abs=1e-12)
