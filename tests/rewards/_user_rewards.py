"""Reward functions loaded by path in the worker tests (a user's reward file needs only `rewards`)."""
import os
import time

from rewards import RewardResult, batched


def length_reward(*, completion, **_):
    return float(len(completion))


def sleep_forever(*, completion, **_):
    if completion == "hang":
        time.sleep(10_000)
    return 1.0


def raise_on_bad(*, completion, **_):
    if completion == "bad":
        raise RuntimeError("boom")
    return 1.0


def die_on_bad(*, completion, **_):
    if completion == "bad":
        os._exit(3)  # the worker process disappears mid-call
    return 1.0


async def async_reward(*, completion, answer, scale: float = 1.0):
    return RewardResult(scale * float(completion == answer), {"seen": completion})


@batched
def batched_len(*, completion):
    return [len(c) for c in completion]


def wrong_type(*, completion):
    return "not a number"


def needs_unknown(*, completion, rubric):
    return 1.0
