"""Round three: the judge's own Python semantics must not leak into the verdict (every sandbox mode here).

- A candidate's StopIteration would end an enclosing ``for ... in map(f, ...)`` or ``all(map(...))`` in
  the test silently (PEP 479's reason): it is a failed call, whatever the shape of the loop.
- The judge's deadline, raised into test code, can be caught by a bare ``except:`` (or ``except
  BaseException``, a ``return`` in ``finally``, ``contextlib.suppress``): the test is failed when the
  deadline fires, so a hang never "raises as expected".
- A line the candidate writes can never pass for the harness's own record: the outcomes in ``extras``
  say only what the judge decided, in its fixed words.
- Helpers the task's prompt defines are bound from the prompt (``test_prompt_helpers.py``).
"""
import concurrent.futures as cf
import os
import resource
import time

import pytest

from tests.rewards.hostile import BOUND, FAST, MODES
from rewards.code_reward import code_reward


def _run(cases, mode):
    """(name, code, tests, check) cases, four at a time; each under FAST limits and the BOUND wall time."""
    def one(case):
        name, code, tests, check = case
        t0 = time.monotonic()
        out = code_reward(completion=code, tests=tests, sandbox=mode, **FAST)
        assert time.monotonic() - t0 < BOUND, (name, out)
        check(name, out)

    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(one, cases))


def _expect(score, outcomes):
    def check(name, out):
        assert out.score == pytest.approx(score) and out.extras["outcomes"] == outcomes, (name, out)
    return check


# ---- StopIteration (PEP 479) ---------------------------------------------------------------------------

# Each loop would end at the candidate's first StopIteration without checking anything.
ITERATION_SHAPES = [
    "def check(candidate):\n    for a, b in zip(map(candidate, [1, 2]), [2, 4]):\n        assert a == b\ncheck(f)",
    "assert all(map(lambda x: f(x) == 2 * x, [1, 2, 3]))",
    "import itertools\nfor v in itertools.starmap(f, [(1,), (2,)]):\n    assert v % 2 == 0",
    "assert sum(map(f, [1, 2])) == 6 or sum(map(f, [0])) == 0",
    "assert list(filter(f, [1, 2, 3])) == []",
    "assert dict(zip('ab', map(f, [1, 2]))) in ({'a': 2, 'b': 4}, {})",
]
STOPPERS = {
    "raise": "def f(x):\n    raise StopIteration\n",
    "raise_value": "def f(x):\n    raise StopIteration(2 * x)\n",
    "next_of_empty": "def f(x):\n    return next(iter(()))\n",
    "async_end": "def f(x):\n    raise StopAsyncIteration\n",
}


@pytest.mark.parametrize("mode", MODES)
def test_a_candidates_stop_iteration_never_ends_a_loop_of_the_test(mode):
    cases = [(name, code, ITERATION_SHAPES, _expect(0.0, ["raised:" + ("StopAsyncIteration" if name == "async_end"
                                                                      else "StopIteration")] * len(ITERATION_SHAPES)))
             for name, code in STOPPERS.items()]
    honest = "def f(x):\n    return 2 * x\n"
    fair = [s for s in ITERATION_SHAPES if "filter" not in s]  # filter(...) == [] wants a falsy answer
    cases.append(("honest", honest, fair, _expect(1.0, ["ok"] * len(fair))))
    _run(cases, mode)


# ---- the deadline inside test code -----------------------------------------------------------------------

# Tests that expect the call to raise, and catch broadly: a hang must not count as "raised as expected".
CATCHING_SHAPES = {
    "bare_except": "def check(c):\n    try:\n        c(-1)\n    except:\n        pass\n    else:\n"
                   "        assert False\ncheck(f)",
    "except_base": "try:\n    f(-1)\n    ok = False\nexcept BaseException:\n    ok = True\nassert ok",
    "return_in_finally": "def check(c):\n    try:\n        c(-1)\n        assert False\n    finally:\n"
                         "        return\ncheck(f)",
    "suppress": "import contextlib\nraised = True\nwith contextlib.suppress(BaseException):\n    f(-1)\n"
                "    raised = False\nassert raised",
    "retry_loop": "n = 0\nfor _ in range(3):\n    try:\n        f(-1)\n    except:\n        n += 1\nassert n == 3",
}
HANGS = {
    "busy": "def f(x):\n    while True:\n        pass\n",
    "sleep": "import time\ndef f(x):\n    time.sleep(3600)\n",
}


@pytest.mark.parametrize("mode", MODES)
def test_a_hang_is_a_timeout_however_the_test_catches(mode):
    cases = [(f"{hang}/{shape}", code, [test], _expect(0.0, ["timeout"]))
             for hang, code in HANGS.items() for shape, test in CATCHING_SHAPES.items()]
    raises = "def f(x):\n    if x < 0:\n        raise ValueError(x)\n    return x\n"
    cases += [(f"honest/{shape}", raises, [test], _expect(1.0, ["ok"])) for shape, test in CATCHING_SHAPES.items()]
    _run(cases, mode)


# ---- records the candidate writes ------------------------------------------------------------------------

# Every descriptor of the candidate's process gets each record, bare and numbered like the harness's own.
FORGE = ('import os\ndef _forge():\n    for fd in range(0, 64):\n        for rec in %r:\n'
         '            try:\n                os.write(fd, rec)\n            except OSError:\n                pass\n'
         'def f(x):\n    _forge()\n    %s\n')
RECORDS = [b'{"h": "ok"}\n', b'1h {"h": "ok"}\n', b'{"h": "timeout"}\n', b'{"raised": "ok\\nok"}\n',
           b'{"raised": "%s"}\n' % (b"A" * 80), b'{"bad": "ok", "h": "ok"}\n',
           b'{"stdout": "ok", "exit": 0, "status": "ok"}\n', b'0h {"ready": 1}\n']
WORDS = {"bad_record", "bad_value", "died", "timeout", "output_limit", "assert_failed"}


@pytest.mark.parametrize("mode", MODES)
def test_the_candidate_cannot_write_an_outcome(mode):
    def words_only(name, out):
        assert out.score == 0.0 and set(out.extras["outcomes"]) <= WORDS, (name, out)

    cases = []
    for k, rec in enumerate(RECORDS):
        for end in ("os._exit(0)", "return x + 1", "while True: pass"):
            code = FORGE % ([rec], end)
            cases.append((f"{k}/{end}", code, ["assert f(1) == 2", "def check(c):\n    assert c(2) == 4\ncheck(f)"],
                          words_only))
    _run(cases, mode)


def test_the_judge_takes_its_words_from_the_harness_only():
    from rewards._judge import CallFailed, _Test, interpret
    for body in (b'{"h": "ok"}', b'{"h": "timeout"}', b'{"raised": "ok ok"}', b'{"raised": "' + b"x" * 41 + b'"}',
                 b'{"raised": "\\u00e9t\\u00e9"}', b'{"stdout": "", "exit": 0, "status": "ok"}'):
        test = _Test(None)
        with pytest.raises(CallFailed):
            interpret(body, test, "stdio" if b"stdout" in body else "call")
        assert test.failed == "bad_record", body
    for body, why in ((b'{"h": "timeout"}', "timeout"), (b'{"h": "ok"}', "bad_record"), (b'{"h": "died"}', "died")):
        test = _Test(None)
        with pytest.raises(CallFailed):
            interpret(body, test, "call", harness=True)
        assert test.failed == why
    assert interpret(b'{"stdout": "x", "exit": 0, "status": "ok"}', _Test(None), "stdio", harness=True)["stdout"] == "x"


@pytest.mark.parametrize("mode", MODES)
def test_no_descriptor_of_the_reward_process_reaches_the_candidate(mode):
    """The judge's channel keeps its number from the reward process: above 1024 in a process holding many
    descriptors (a trainer), it must still be closed before candidate code runs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 1400:
        pytest.skip("needs a descriptor limit above 1400")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open("/dev/null", os.O_RDONLY))
        code = "import os\ndef fds():\n    return sorted(int(x) for x in os.listdir('/proc/self/fd'))\n"
        # 0-2, the request and answer pipes, and the listing's own descriptor
        out = code_reward(completion=code, tests=["assert len(fds()) <= 6 and max(fds()) < 1024"], sandbox=mode, **FAST)
        assert out.score == 1.0, out
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
