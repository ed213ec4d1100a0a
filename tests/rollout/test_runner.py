"""`rollout.runner.EagerRunner`'s own calls, against plain lists of what each documents: a sequence's slot holds
its prompt then [MASK]s (place) or an adopted canvas and trace (load); append writes after a turn; read / copy_out
return host lists; reset_block restarts the block counters; free and invalidate give keys/values back (all of
them / from a block on); forward counts its model calls and rows. The decisions a forward writes are checked
through the engine (tests/rollout/engine/)."""
import random

import torch

from rollout.config import DecodeConfig
from rollout.runner import EagerRunner, RowOutcome
from rollout.sequence import Sequence
from tests.support.stub_engine_model import MASK, StubModel

K, T, B = 4, 16, 3


def _runner(use_cache=True):
    return EagerRunner(StubModel(K), DecodeConfig.preset("quality", use_cache=use_cache), max_batch=B, canvas_len=T,
                       K=K, mask_id=MASK, model_lev_ids=None, share_prefix=False)


def _seq(slot, prompt):
    return Sequence(id=slot, prompt=list(prompt), slot=slot, cfg=DecodeConfig.preset("quality"))


def test_slots_start_as_masks_and_place_load_append_write_what_they_document():
    r = _runner()
    assert r.slots.canvas.tolist() == [[MASK] * T] * B and r.slots.trace.tolist() == [[-1] * T] * B
    rng = random.Random(0)
    want = [[MASK] * T for _ in range(B)]
    trace = [[-1] * T for _ in range(B)]
    a = _seq(1, [rng.randrange(20) for _ in range(5)])
    r.place(a, [])
    want[1][:5] = a.prompt
    b = _seq(2, [3, 4])
    b.canvas, b.trace = [rng.randrange(20) for _ in range(T + 3)], [rng.randrange(5) for _ in range(T + 3)]
    r.load(b, [a])  # longer than the canvas: cut at T
    want[2], trace[2] = b.canvas[:T], b.trace[:T]
    r.append(a, 8, [7, 8, 9])
    want[1][8:11] = [7, 8, 9]
    assert r.slots.canvas.tolist() == want and r.slots.trace.tolist() == trace
    assert r.read(a, 3, 10) == want[1][3:10] and r.copy_out(b, 9) == (want[2][:9], trace[2][:9])
    r.slots.trace[1, :5] = 0
    c = _seq(1, [6])  # the slot's next sequence: nothing of the last one is left
    r.place(c, [])
    assert r.slots.canvas[1].tolist() == [6] + [MASK] * (T - 1) and r.slots.trace[1].tolist() == [-1] * T


def test_reset_block_restarts_only_that_slot_s_counters():
    r = _runner()
    r.slots.post_steps[:] = torch.tensor([1, 2, 3])
    r.slots.block_iters[:] = torch.tensor([4, 5, 6])
    r.reset_block(_seq(1, [1]))
    assert r.slots.post_steps.tolist() == [1, 0, 3] and r.slots.block_iters.tolist() == [4, 0, 6]


def test_free_and_invalidate_give_back_keys_and_values_by_the_rule():
    r = _runner()
    s = _seq(0, [1, 2, 3, 4, 5, 6])
    r.place(s, [])
    r.cache.lengths[0] = 12  # three blocks of keys/values held
    r.invalidate(s, 5, 6)  # blocks after the ones held: nothing to drop
    assert r.cache.lengths[0] == 12
    r.invalidate(s, 2, 2)
    assert r.cache.lengths[0] == 2 * K
    r.invalidate(s, 1, 3)
    assert r.cache.lengths[0] == K
    r.free(s)
    assert r.cache.lengths[0] == 0


def test_without_the_cache_nothing_is_held_or_dropped():
    r = _runner(use_cache=False)
    s = _seq(0, [1, 2])
    r.place(s, [])
    r.invalidate(s, 0, 1)
    r.free(s)
    assert r.cache is None and r.waits_for_prefix(s) is False


def test_forward_counts_its_calls_and_rows_and_reports_each_row():
    r = _runner()
    rows = [_seq(i, [1 + i, 2, 3, 4, 5][:3 + i]) for i in range(B)]
    for s in rows:
        r.place(s, [])
        s.start, s.block, s.num_blocks = s.prompt_len, s.prompt_len // K, T // K
    out = r.forward(rows, None)
    assert len(out) == B and all(isinstance(o, RowOutcome) for o in out)
    out = r.forward(rows[:2], None)
    assert (r.num_forwards, r.row_forwards, len(out)) == (2, B + 2, 2)
    # the prompt positions each row ran: all of them first (12), then those in the still-active block only: row 0's
    # prompt (3 tokens) lies in its active block 0, row 1's (4) filled block 0, which the first forward committed
    assert r.prompt_tokens_computed == 12 + 3 + 0
