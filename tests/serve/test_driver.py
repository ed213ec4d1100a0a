"""`EngineDriver` (ebpo/serve/driver.py): one engine for the server's whole life, requests with different settings
in the same forwards, aborts that free a request's rows at the next forward."""
import concurrent.futures
import time

import pytest
import torch

from ebpo.model import LLaDA2MoeModelLM, tiny_config
from ebpo.serve.driver import EngineDriver
from rollout import DecodeConfig, generate


@pytest.fixture(scope="module")
def model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = LLaDA2MoeModelLM(tiny_config()).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


def _wait(driver, futures, timeout=120):
    done, _ = concurrent.futures.wait(futures, timeout=timeout)
    assert len(done) == len(futures), "the driver did not finish in time"


def test_distinct_settings_share_one_engine_and_forwards(model):
    """32 requests with distinct temperatures (plus two presets) run in the driver's one engine, share forwards,
    and each gets the tokens `generate` gives it alone; nothing stays behind in the engine."""
    driver = EngineDriver(model, None, max_batch=32, max_len=64).start()
    try:
        engine = driver.engine
        cfgs = [DecodeConfig.preset("speed" if i % 2 else "quality", temperature=0.3 + 0.05 * i, max_new_tokens=8)
                for i in range(32)]
        prompts = [[5 + i % 7, 6, 7 + i % 3] for i in range(32)]
        futs = [driver.submit(p, c, torch.Generator().manual_seed(i)) for i, (p, c) in enumerate(zip(prompts, cfgs))]
        _wait(driver, futs)
        seqs = [f.result() for f in futs]
        assert driver.engine is engine
        assert driver.num_forwards < sum(s.forwards for s in seqs)  # the rows shared model calls
        for i in (0, 1, 17, 31):
            alone = generate(model, [prompts[i]], cfgs[i], seeds=[i])[0]
            assert seqs[i].canvas[3:3 + len(alone.token_ids)] == alone.token_ids
        deadline = time.monotonic() + 5
        while engine.sequences and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.sequences == [] and not engine.active and len(engine.free) == 32
    finally:
        driver.close()


def test_abort_cancels_the_request_and_frees_its_rows(model):
    """An aborted request's future raises CancelledError, its rows leave the engine, and the other requests
    finish with their own tokens."""
    driver = EngineDriver(model, None, max_batch=4, max_len=256).start()
    try:
        long = DecodeConfig.preset("quality", temperature=0.8, max_new_tokens=200, stop_at_eos=False)
        short = DecodeConfig.preset("quality", max_new_tokens=8)
        victims = [driver.submit([5, 6, 7], long, torch.Generator().manual_seed(i)) for i in range(3)]
        keep = driver.submit([9, 10], short)
        deadline = time.monotonic() + 30
        while driver.num_forwards < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        for f in victims:
            driver.abort(f)
        _wait(driver, [keep])
        for f in victims:
            with pytest.raises(concurrent.futures.CancelledError):
                f.result(timeout=30)
        ids = generate(model, [[9, 10]], short)[0].token_ids
        assert keep.result().canvas[2:2 + len(ids)] == ids
        deadline = time.monotonic() + 5
        while driver.engine.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not driver.engine.active and len(driver.engine.free) == 4
        assert driver.row_forwards < 3 * 200  # the aborted rows stopped long before their 200 tokens
    finally:
        driver.close()


# ---- fast checks of the driver's contract, on the small model of tests/support (block 4) ----------------------

@pytest.fixture(scope="module")
def small():
    from tests.support.models import small_lm

    return small_lm().eval()


GREEDY = DecodeConfig.preset("quality", max_new_tokens=8)


def _finish(futures, timeout=60):
    done, _ = concurrent.futures.wait(futures, timeout=timeout)
    assert len(done) == len(futures), "the driver did not finish in time"


def test_a_submission_gives_the_tokens_generate_gives_and_leaves_nothing_behind(small):
    driver = EngineDriver(small, None, max_batch=2, max_len=32).start()
    try:
        # three requests for two slots: the third waits for a freed one
        futs = [driver.submit([5, 6, 7], GREEDY), driver.submit([9, 10], GREEDY, max_new_tokens=4),
                driver.submit((11, 12, 13, 14), GREEDY.replace(tau_mask=0.5, max_new_tokens=12))]
        _finish(futs)
        seqs = [f.result() for f in futs]
        for s, p, cfg, n in zip(seqs, ([5, 6, 7], [9, 10], [11, 12, 13, 14]),
                                (GREEDY, GREEDY, GREEDY.replace(tau_mask=0.5)), (8, 4, 12)):
            alone = generate(small, [p], cfg.replace(max_new_tokens=n))[0].token_ids
            assert s.prompt == p and s.canvas[len(p):len(p) + len(alone)] == alone
            assert s.max_new == n  # the call's own length, else its config's
        assert driver.num_forwards == driver.engine.num_forwards > 0
        assert driver.row_forwards == driver.engine.row_forwards >= driver.num_forwards
        assert driver.pending == {} and driver.watched == {}
        assert driver.engine.sequences == [] and len(driver.engine.free) == 2  # forgotten once collected
        assert driver.error is None
    finally:
        driver.close()
    assert not driver._thread.is_alive() and driver._thread.daemon  # a daemon: it never holds the process


def test_sampled_requests_use_their_own_generators(small):
    """temperature > 0: each request samples with the generator it brought, so its tokens are those of `generate`
    with that seed, whatever else decodes beside it."""
    cfg = DecodeConfig.preset("quality", max_new_tokens=12, temperature=1.0, stop_at_eos=False)
    driver = EngineDriver(small, None, max_batch=4, max_len=32).start()
    try:
        futs = [driver.submit([5, 6, 7], cfg, torch.Generator().manual_seed(seed)) for seed in (1, 2, 1)]
        _finish(futs)
    finally:
        driver.close()
    for f, seed in zip(futs, (1, 2, 1)):
        alone = generate(small, [[5, 6, 7]], cfg, seeds=[seed])[0].token_ids
        assert f.result().canvas[3:3 + len(alone)] == alone


def test_the_defaults_of_the_signature(small):
    d = EngineDriver(small, None)
    assert (d.max_batch, d.max_len, d.engine.max_batch, d.turns, d.error) == (16, 1024, 16, None, None)


def test_an_idle_driver_waits_on_its_inbox_and_a_busy_one_does_not(small):
    """Idle: the loop waits up to 0.1 s for a submission (no busy spinning); decoding: it never waits between
    steps (the inbox is only peeked)."""
    driver = EngineDriver(small, None, max_batch=2, max_len=160)
    calls = []
    step = driver.engine.step

    def counted():
        calls.append(time.monotonic())
        return step()

    driver.engine.step = counted
    driver.start()
    try:
        time.sleep(0.6)
        idle = len(calls)
        cfg = DecodeConfig.preset("m2t", tau_mask=0.0, max_new_tokens=120, stop_at_eos=False)
        t0 = time.monotonic()
        fut = driver.submit([5, 6, 7], cfg)
        _finish([fut])
        busy = [t for t in calls if t >= t0]
        took = time.monotonic() - t0
    finally:
        driver.close()
    assert idle <= 12, idle  # about one step per 0.1 s wait
    assert len(busy) >= 30 and took < 0.1 * len(busy), (len(busy), took)  # no 0.1 s wait per step


class _HeldForward(torch.nn.Module):
    """Delegates to `model` once `free` is set: until then a forward (and the driver thread in it) hangs."""

    def __init__(self, model):
        super().__init__()
        import threading

        self.inner, self.config, self.free = model, model.config, threading.Event()
        self.lm_head = model.lm_head

    def forward(self, *a, **kw):
        self.free.wait(30)
        return self.inner(*a, **kw)


def test_close_gives_up_on_a_stuck_thread_after_its_timeout(small):
    held = _HeldForward(small)
    driver = EngineDriver(held, None, max_batch=1, max_len=16).start()
    try:
        driver.submit([5, 6], GREEDY)
        time.sleep(0.3)  # the driver thread is inside the held forward
        t0 = time.monotonic()
        driver.close(timeout=0.3)
        assert time.monotonic() - t0 < 3.0
    finally:
        held.free.set()
    driver._thread.join(30)


def test_a_prompt_the_engine_refuses_fails_its_future_only(small):
    driver = EngineDriver(small, None, max_batch=2, max_len=16).start()
    try:
        bad = driver.submit(list(range(5, 25)), GREEDY)  # 20 tokens: no room in 16 positions
        good = driver.submit([5, 6], GREEDY)
        _finish([bad, good])
        with pytest.raises(ValueError, match="does not fit the canvas"):
            bad.result()
        assert good.result().status == "finished" and driver.pending == {}
    finally:
        driver.close()


def test_on_start_runs_in_the_driver_thread_with_the_engines_sequence(small):
    import threading

    seen = []
    driver = EngineDriver(small, None, max_batch=2, max_len=32).start()
    try:
        fut = driver.submit([5, 6], GREEDY, on_start=lambda s, d: seen.append((s, d, threading.current_thread().name)))
        _finish([fut])
    finally:
        driver.close()
    assert len(seen) == 1 and seen[0][0] is fut.result() and seen[0][1] is driver
    assert seen[0][2] == "ebpo-engine-driver"


def test_an_abort_before_the_driver_picks_it_up_cancels_it_and_nothing_runs(small):
    driver = EngineDriver(small, None, max_batch=2, max_len=32)  # not started: the inbox waits
    fut = driver.submit([5, 6, 7], GREEDY)
    driver.abort(fut)
    assert fut.cancelled()
    other = driver.submit([5, 6], GREEDY)
    driver.start()
    try:
        _finish([other])
        assert driver.engine.num_forwards > 0
        assert all(s.prompt != [5, 6, 7] for s in driver.engine.sequences)
        assert driver.pending == {}
        driver.abort(other)  # a finished future: left alone
        driver.abort(concurrent.futures.Future())  # an unknown one too
        again = driver.submit([5, 6], GREEDY)
        _finish([again])
        assert other.result().canvas == again.result().canvas and not other.cancelled()
    finally:
        driver.close()


def test_an_aborted_stream_stops_reporting_and_its_rows_are_freed(small):
    driver = EngineDriver(small, None, max_batch=1, max_len=64).start()
    try:
        long = DecodeConfig.preset("quality", max_new_tokens=40, stop_at_eos=False)
        blocks = []
        fut = driver.submit([5, 6, 7, 8], long, on_block=lambda s, toks: blocks.append(len(toks)))
        deadline = time.monotonic() + 30
        while not blocks and time.monotonic() < deadline:
            time.sleep(0.005)
        driver.abort(fut)
        with pytest.raises(concurrent.futures.CancelledError, match="^aborted by the caller$"):
            fut.result(timeout=30)
        after = driver.submit([5, 6], GREEDY)  # the one slot is free again
        _finish([after])
        assert driver.pending == {} and driver.watched == {} and driver.engine.sequences == []
        assert max(blocks) < 40
    finally:
        driver.close()


@pytest.mark.parametrize("window", [0, 1])
def test_on_block_reports_only_committed_blocks_in_order(small, window):
    """Each report is the generated tokens up to the start of the active block, w = mbe_window blocks further
    back with Multi-Block Editing (driver docstring); every report is a prefix of the final tokens, and the last
    blocks come with the finished sequence, not as a report."""
    K = small.config.block_size
    cfg = DecodeConfig.preset("quality", max_new_tokens=20, stop_at_eos=False, mbe_window=window, temperature=0.9)
    reports = []

    def on_block(s, toks):
        reports.append((s.block, list(toks)))

    driver = EngineDriver(small, None, max_batch=2, max_len=64).start()
    try:
        prompt = list(range(5, 12 - window))  # 7 or 6 tokens: the first block is shared by prompt and answer
        fut = driver.submit(prompt, cfg, torch.Generator().manual_seed(3), on_block=on_block)
        _finish([fut])
    finally:
        driver.close()
    s = fut.result()
    assert driver.watched == {} and driver.pending == {}  # a finished stream is no longer watched
    final = s.canvas[len(prompt):len(prompt) + 20]
    assert reports, "nothing was streamed"
    lens = [len(t) for _, t in reports]
    assert lens == sorted(set(lens)) and lens[0] > 0
    if window == 0:  # the first report: the answer's part of the first block (one token for a 7-token prompt)
        assert lens[0] == K - len(prompt) % K
    for block, toks in reports:
        assert toks == final[:len(toks)]
        assert len(prompt) + len(toks) == (block - window) * K
    assert lens[-1] < 20


def test_every_stream_is_reported_in_the_step_its_blocks_grow(small):
    """Several streams of different lengths in one batch: each report of each stream is one block more than its
    last (blocks commit one at a time, and a stream is reported after every step in which it grew), even in the
    steps where another stream finishes."""
    K = small.config.block_size
    reports: dict = {}
    driver = EngineDriver(small, None, max_batch=4, max_len=64).start()
    try:
        futs = []
        for i, n in enumerate((6, 10, 14, 40)):
            # every mask above tau_mask 0 and no editing: each block ends after one forward, so a stream grows
            # in every step, also the steps in which another one finishes
            cfg = DecodeConfig.preset("m2t", tau_mask=0.0, max_new_tokens=n, stop_at_eos=False, temperature=0.7)
            futs.append(driver.submit([5, 6, 7, 8], cfg, torch.Generator().manual_seed(i),
                                      on_block=lambda s, toks, i=i: reports.setdefault(i, []).append(len(toks))))
        _finish(futs)
    finally:
        driver.close()
    for i, lens in reports.items():
        assert lens == [K * (j + 1) for j in range(len(lens))], (i, lens)
    assert len(reports[3]) == 40 // K - 1  # every block but the last, which comes with the finished sequence


def test_committed_tokens_is_none_unless_a_block_is_decoding(small):
    from types import SimpleNamespace

    driver = EngineDriver(small, None, max_batch=1, max_len=32)
    cfg = SimpleNamespace(mbe_window=0)
    assert driver.committed_tokens(SimpleNamespace(status="queued", slot=0, mbe_start=None, cfg=cfg)) is None
    assert driver.committed_tokens(SimpleNamespace(status="decoding", slot=None, mbe_start=None, cfg=cfg)) is None
    assert driver.committed_tokens(SimpleNamespace(status="decoding", slot=0, mbe_start=2, cfg=cfg)) is None
    # the first block of the answer is active: nothing committed yet
    first = SimpleNamespace(status="decoding", slot=0, mbe_start=None, cfg=cfg, block=1, prompt_len=4, max_new=8)
    assert driver.committed_tokens(first) == []
    for block in (0, 1, 2):  # the MBE window reaches back before the answer: nothing committed
        early = SimpleNamespace(status="decoding", slot=0, mbe_start=None, cfg=SimpleNamespace(mbe_window=2),
                                block=block, prompt_len=4, max_new=8)
        assert driver.committed_tokens(early) == []


class _RaisingForward(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    def forward(self, *a, **kw):
        raise RuntimeError("the device fell over")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failing_engine_fails_every_waiting_caller_and_later_submissions(small):
    driver = EngineDriver(_RaisingForward(small), None, max_batch=2, max_len=32).start()
    try:
        futs = [driver.submit([5, 6], GREEDY), driver.submit([7, 8], GREEDY)]
        _finish(futs)
        for f in futs:
            with pytest.raises(RuntimeError, match="the engine driver failed: RuntimeError.*fell over"):
                f.result()
        driver._thread.join(10)
        assert isinstance(driver.error, RuntimeError)
        late = driver.submit([5, 6], GREEDY)
        assert late.done()
        with pytest.raises(RuntimeError, match="the engine driver stopped: RuntimeError"):
            late.result()
    finally:
        driver.close()


def test_close_stops_an_idle_driver_promptly(small):
    driver = EngineDriver(small, None, max_batch=1, max_len=16)
    driver.close()  # never started: nothing to join
    driver = EngineDriver(small, None, max_batch=1, max_len=16).start()
    t0 = time.monotonic()
    driver.close()
    assert not driver._thread.is_alive() and time.monotonic() - t0 < 5


class _CharTok:
    eos_token_id = 1

    def decode(self, ids, **kw):
        return "".join(chr(65 + i % 26) for i in ids)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - 65 for c in text]}


class _OneTurnEnv:
    """Answers the first turn with `done`: the trajectory ends after one turn."""

    def __init__(self):
        self.texts = []

    def step(self, text):
        self.texts.append(text)
        return None, 1.0, True, {}


def test_a_sequence_with_an_environment_goes_through_the_multi_turn_client(small):
    from rollout.multiturn import MultiTurnConfig

    mt = MultiTurnConfig(max_turns=2, max_turn_tokens=8, max_total_tokens=32, step_timeout_s=10.0)
    driver = EngineDriver(small, _CharTok(), max_batch=2, max_len=48, mt=mt).start()
    try:
        env, reports = _OneTurnEnv(), []
        fut = driver.submit([5, 6, 7], GREEDY, env=env, on_block=lambda s, t: reports.append(t))
        plain = driver.submit([5, 6, 7], GREEDY)  # single-turn beside it: the engine's own path
        _finish([fut, plain])
    finally:
        driver.close()
    s = fut.result()
    assert s.env is env and len(s.turns) == 1 and len(env.texts) == 1
    assert s.turns[0].text == env.texts[0]
    assert reports == []  # on_block is for single-turn sequences only
    assert plain.result().env is None and plain.result().turns == []
