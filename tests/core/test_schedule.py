"""The learning-rate schedules (ebpo.core.schedule) against their docstrings read literally, on a grid of progress,
step sizes, warm-ups, totals and floors; the defaults are a cosine down to zero."""
import math

import pytest

from ebpo.core.schedule import lr_schedule


def plain(progress, step, warmup, total, schedule, min_ratio):
    end = progress + step
    if warmup > 0 and end <= warmup:  # linear in the step's end while that end is within the warm-up
        return end / warmup
    if schedule == "constant":
        return 1.0
    # cosine from 1 at warmup to min_ratio at total, at the step's start, flat outside [warmup, total]
    span = max(total - warmup, 1)
    q = min(max((progress - warmup) / span, 0.0), 1.0)
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * q)) / 2


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_schedule_matches_its_docstring_on_a_grid(schedule):
    for warmup in (0, 1, 3, 10):
        for total in (1, 5, 10, 25):
            for min_ratio in (0.0, 0.1, 0.5):
                for step in (1.0, 0.5, 0.25):
                    p = 0.0
                    while p <= total + 3:
                        got = lr_schedule(p, step, warmup, total, schedule, min_ratio)
                        assert got == pytest.approx(plain(p, step, warmup, total, schedule, min_ratio), abs=1e-12)
                        p += step


def test_schedule_landmarks():
    assert lr_schedule(0, 1, 4, 10) == 0.25  # the very first step trains
    assert lr_schedule(3, 1, 4, 10) == 1.0  # the warm-up's last step reaches 1
    assert lr_schedule(4, 1, 4, 10, "cosine", 0.2) == 1.0  # the cosine starts at 1
    assert lr_schedule(10, 1, 4, 10, "cosine", 0.2) == pytest.approx(0.2)  # and ends at the floor
    assert lr_schedule(9, 1, 4, 10, "cosine", 0.0) > 0  # the last scheduled step still trains
    assert lr_schedule(50, 1, 4, 10, "cosine", 0.3) == pytest.approx(0.3)  # stays there after total
    assert lr_schedule(7, 1, 0, 10, "constant") == 1.0
    with pytest.raises(ValueError, match=r"^schedule: choose constant or cosine, got 'linear'$"):
        lr_schedule(5, 1, 2, 10, "linear")


def test_schedule_defaults_are_cosine_to_zero():
    for p in (4, 5, 7, 9):
        assert lr_schedule(p, 1, 4, 10) == lr_schedule(p, 1, 4, 10, "cosine", 0.0)
    assert lr_schedule(7, 1, 4, 10) < 1.0 and lr_schedule(10, 1, 4, 10) == pytest.approx(0.0)


def test_lr_schedule_defaults_to_a_cosine_down_to_zero():
    """Without `schedule` and `min_ratio`: cosine from 1 at the end of warm-up to 0 at `total`, read at the
    step's start, and 0 after `total`."""
    warmup, total = 3, 13
    for progress in [3, 4, 5.5, 8, 12, 13, 20]:
        q = min(max((progress - warmup) / (total - warmup), 0.0), 1.0)
        want = 0.5 * (1 + math.cos(math.pi * q))
        assert lr_schedule(progress, 1.0, warmup, total) == pytest.approx(want, abs=1e-12), progress
    assert lr_schedule(13, 1.0, warmup, total) == pytest.approx(0.0, abs=1e-12)
    assert lr_schedule(1, 1.0, warmup, total) == pytest.approx(2 / 3)  # warm-up: the step's end over warmup


def warmup_cosine(step, warmup, total, min_ratio):
    """The SFT trainer's schedule: optimizer step `step` of the shared one, lasting one step."""
    return lr_schedule(step, 1.0, warmup, total, "cosine", min_ratio)


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)
