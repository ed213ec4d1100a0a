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
