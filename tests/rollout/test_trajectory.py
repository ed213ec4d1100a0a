"""`rollout.trajectory` records against plain re-statements of their documented rules, on random trajectories:
per-trajectory metrics, the plain-data round trip, the table text and the batch summary."""
import random

import pytest

from rollout.trajectory import Trajectory, TurnRecord, summarize, trajectory_text

STOPS = ["done", "max_turns", "max_total_tokens", "observation_overflow", "env_error", "env_timeout"]


def _call(rng, i):
    c = {"name": f"tool{i}", "arguments": {"x": i}, "result": "r" * rng.randint(0, 5)}
    if rng.random() < 0.8:
        c["ok"] = rng.random() < 0.5
    if rng.random() < 0.5:
        c["timeout"] = rng.random() < 0.5
    if rng.random() < 0.8:
        c["latency_s"] = rng.choice([0.25, 0.5, 1.5])
    if not c.get("ok"):
        c["error"] = "boom" * rng.randint(1, 3)
    return c


def _trajectory(seed):
    rng = random.Random(seed)
    P = rng.randint(0, 4)
    n = P + rng.randint(0, 12)
    turns = []
    for t in range(rng.randint(0, 3)):
        calls = [_call(rng, 10 * t + j) for j in range(rng.randint(0, 2))]
        turns.append(TurnRecord(index=t, start=P, end=n, text=f"turn {t}", finished_by=rng.choice(["eos", "budget"]),
                                observation=rng.choice([None, "obs" * 80, "o"]), reward=rng.choice([0.0, 0.5, 1.0]),
                                tool_calls=calls, env_latency_s=rng.choice([0.0, 0.125, 2.0]),
                                error=rng.choice([None, None, "E" * 300])))
    generated = [False] * P + [rng.random() < 0.5 for _ in range(n - P)]
    segment = [0] * P + [rng.randint(0, 3) for _ in range(n - P)]
    return Trajectory(prompt_ids=list(range(P)), ids=list(range(n)), generated=generated, segment=segment,
                      turns=turns, stop=rng.choice(STOPS), failed=rng.random() < 0.3, error=rng.choice([None, "x" * 250]),
                      env_reward=sum(t.reward for t in turns), num_forwards=rng.randint(0, 9))


def _metrics(t):
    calls = [c for turn in t.turns for c in turn.tool_calls]
    env = sum(1 for i in range(len(t.ids)) if not t.generated[i] and t.segment[i] > 0)
    return {"turns": len(t.turns), "tool_calls": len(calls),
            "tool_errors": sum(1 for c in calls if c.get("ok") is not True),
            "tool_timeouts": sum(1 for c in calls if c.get("timeout") is True),
            "tool_latency_s": sum(c.get("latency_s", 0.0) for c in calls),
            "env_latency_s": sum(turn.env_latency_s for turn in t.turns),
            "env_token_share": env / max(1, len(t.ids) - len(t.prompt_ids)),
            "failed": 1.0 if t.failed else 0.0, "generated_tokens": sum(t.generated),
            "observation_overflow": 1.0 if t.stop == "observation_overflow" else 0.0}


@pytest.mark.parametrize("seed", range(20))
def test_metrics_match_their_documented_definitions(seed):
    t = _trajectory(seed)
    assert t.metrics() == pytest.approx(_metrics(t))
    assert t.num_generated == sum(t.generated)
    assert t.tool_calls == [c for turn in t.turns for c in turn.tool_calls]


def test_env_token_share_of_a_trajectory_with_nothing_after_the_prompt_is_zero():
    t = Trajectory(prompt_ids=[1, 2], ids=[1, 2], generated=[False, False], segment=[0, 0], turns=[], stop="done")
    assert t.metrics()["env_token_share"] == 0.0


@pytest.mark.parametrize("after", [1, 2, 3])
def test_env_token_share_when_every_token_after_the_prompt_is_the_environments(after):
    """The share is environment tokens over the tokens after the prompt: 1.0 when the environment wrote all of
    them, however few (one token included)."""
    t = Trajectory(prompt_ids=[1, 2], ids=[1, 2] + [7] * after, generated=[False] * (2 + after),
                   segment=[0, 0] + [2] * after, turns=[], stop="done")
    assert t.metrics()["env_token_share"] == 1.0


@pytest.mark.parametrize("seed", range(10))
def test_plain_data_round_trip(seed):
    t = _trajectory(seed)
    d = t.to_dict()
    assert isinstance(d["turns"], list) and all(isinstance(x, dict) for x in d["turns"])
    back = Trajectory.from_dict(d)
    assert back == t and all(isinstance(x, TurnRecord) for x in back.turns)
    assert Trajectory.from_dict({**d, "turns": None}).turns == []


def _text(d, cut):
    lines = []
    for t in d["turns"]:
        lines.append("[turn %d, %s] %s" % (t["index"] + 1, t["finished_by"], t["text"]))
        for c in t["tool_calls"]:
            value = c.get("result") if c.get("ok") else "!! " + str(c.get("error"))
            lines.append("  -> %s(%s) = %s" % (c["name"], c["arguments"], str(value)[:cut]))
        if t["error"]:
            lines.append("  environment failed: " + t["error"][:cut])
        elif t["observation"] is not None and not t["tool_calls"]:
            lines.append("  <- " + t["observation"][:cut])
    if d["stop"] == "observation_overflow":
        lines.append("  <- (dropped) " + str(d["error"])[:cut])
    lines.append("[stop: %s, env reward %g]" % (d["stop"], d["env_reward"]))
    return "\n".join(lines)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("cut", [200, 7])
def test_trajectory_text_lines(seed, cut):
    d = _trajectory(seed).to_dict()
    got = trajectory_text(d) if cut == 200 else trajectory_text(d, max_chars=cut)
    assert got == _text(d, cut)


def test_trajectory_text_of_a_bare_record():
    assert trajectory_text({"stop": "done"}) == "[stop: done, env reward 0]"


@pytest.mark.parametrize("seed", range(5))
def test_summarize_means_failures_and_stop_counts(seed):
    trajs = [_trajectory(100 * seed + i) for i in range(1 + seed)]
    got = summarize(trajs)
    per = [_metrics(t) for t in trajs]
    expect = {f"agent/{k}": sum(p[k] for p in per) / len(per) for k in per[0]}
    expect["agent/failed_count"] = sum(1 for t in trajs if t.failed)
    for s in STOPS:
        n = sum(1 for t in trajs if t.stop == s)
        if n:
            expect[f"agent/stop/{s}"] = n
    assert got == pytest.approx(expect)
    assert summarize([]) == {}
