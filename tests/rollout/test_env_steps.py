"""`rollout.env_steps`: env.step calls in daemon threads, at most `max_workers` at once; `unpack_step`'s forms
and checks."""
import threading
import time

import pytest

from rollout.env_steps import StepRunner, unpack_step


class Gate:
    """env.step blocks until released; counts how many run at once."""

    def __init__(self):
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.now = self.most = 0
        self.texts = []

    def step(self, text):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.texts.append(text)
        self.release.wait(5)
        with self.lock:
            self.now -= 1
        return (text.upper(), 1.0, False, {})


def _wait(pred, s=2.0):
    end = time.monotonic() + s
    while not pred() and time.monotonic() < end:
        time.sleep(0.005)
    return pred()


@pytest.mark.parametrize("workers, expect", [(1, 1), (2, 2), (3, 3), (0, 1), (-4, 1)])
def test_at_most_max_workers_steps_run_at_once(workers, expect):
    """Five steps submitted at once: `max(1, max_workers)` of them enter env.step, the others wait for a
    slot; all five finish once released, each with its own answer."""
    env, runner = Gate(), StepRunner(workers)
    futs = [runner.submit(env, f"t{i}") for i in range(5)]
    assert _wait(lambda: env.now == expect)
    time.sleep(0.05)  # the others stay out while the slots are held
    assert env.now == expect and env.most == expect
    env.release.set()
    outs = [f.result(2) for f in futs]
    assert [o[0] for o in outs] == [(f"T{i}", 1.0, False, {}) for i in range(5)] and env.most == expect


def test_a_step_returns_its_value_and_the_seconds_it_took_in_a_daemon_thread():
    class Sleepy:
        def step(self, text):
            self.thread = threading.current_thread()
            time.sleep(0.05)
            return {"observation": text}

    env = Sleepy()
    t0 = time.monotonic()
    value, took = StepRunner(2).submit(env, "x").result(2)
    assert value == {"observation": "x"} and 0.05 <= took <= time.monotonic() - t0
    assert env.thread.daemon and env.thread.name == "ebpo-env-step" and env.thread is not threading.main_thread()


@pytest.mark.parametrize("exc", [RuntimeError("tool"), KeyboardInterrupt(), SystemExit(3)])
def test_a_raising_step_sets_the_exception_on_its_future_only(exc):
    class Bad:
        def step(self, text):
            raise exc

    runner = StepRunner(1)
    bad = runner.submit(Bad(), "x")
    with pytest.raises(type(exc)):
        bad.result(2)
    good_env = Gate()  # the one slot was given back
    good_env.release.set()
    assert runner.submit(good_env, "z").result(2)[0][0] == "Z"


def test_a_cancelled_step_never_runs():
    """A step still waiting for a slot and cancelled is not run when the slot frees."""
    env, runner = Gate(), StepRunner(1)
    first = runner.submit(env, "a")
    assert _wait(lambda: env.now == 1)
    second = runner.submit(env, "b")
    assert second.cancel()
    env.release.set()
    first.result(2)
    third = runner.submit(env, "c")
    third.result(2)
    assert env.texts == ["a", "c"] and second.cancelled()


# ---------------------------------------------------------------------------------------------- unpack_step
@pytest.mark.parametrize("value, want", [
    (("obs", 1, True, {"a": 1}), ("obs", 1.0, True, {"a": 1})),
    ((None, None, 0, {}), (None, 0.0, False, {})),
    (("o", 0.5, "yes", {}), ("o", 0.5, True, {})),
    (["o", 2, 1, {"k": []}], ("o", 2.0, True, {"k": []})),
    ({"observation": "o", "reward": 3, "done": 1, "info": {"x": 2}}, ("o", 3.0, True, {"x": 2})),
    ({"observation": "o"}, ("o", 0.0, False, {})),
    ({"reward": None, "info": None}, (None, 0.0, False, {})),
    ({}, (None, 0.0, False, {})),
])
def test_unpack_step_reads_every_accepted_form(value, want):
    got = unpack_step(value)
    assert got == want
    assert type(got[1]) is float and type(got[2]) is bool


@pytest.mark.parametrize("value, match", [
    ((3, 0.0, False, {}), "observation must be str or None, got int"),
    ((b"o", 0.0, False, {}), "observation must be str or None, got bytes"),
    (("o", 0.0, False, None), "info must be a dict, got NoneType"),
    (("o", 0.0, False, []), "info must be a dict, got list"),
    ({"observation": 1}, "observation must be str or None, got int"),
    ({"info": "x"}, "info must be a dict, got str"),
])
def test_unpack_step_refuses_bad_types_naming_them(value, match):
    with pytest.raises(TypeError, match=match):
        unpack_step(value)


def test_unpack_step_refuses_a_tuple_of_the_wrong_length():
    with pytest.raises(ValueError):
        unpack_step(("o", 1.0, False))
