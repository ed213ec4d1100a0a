"""`rollout.sequence.Sequence`'s documented state rules, checked over every status: which sequences take part in a
forward, the block boundary where weights may change, the weight versions per block, and the pickled form of a
pending environment step."""
import concurrent.futures
import pickle

import pytest

from rollout.sequence import DECODING, FINISHED, MBE, QUEUED, WAITING, Sequence

STATUSES = [QUEUED, DECODING, MBE, WAITING, FINISHED]


@pytest.mark.parametrize("status", STATUSES)
@pytest.mark.parametrize("mbe_start", [None, 2])
@pytest.mark.parametrize("started", [False, True])
def test_ready_and_block_boundary(status, mbe_start, started):
    s = Sequence(id=0, prompt=[1, 2, 3], status=status, block=3, mbe_start=mbe_start,
                 block_versions={3: 1} if started else {1: 0})
    assert s.ready == (status in (DECODING, MBE))
    # waiting on the environment, or decoding a block no forward has touched yet (and not in an MBE window)
    assert s.at_block_boundary == (status == WAITING or (status == DECODING and mbe_start is None and not started))
    assert s.prompt_len == 3


@pytest.mark.parametrize("versions", [{}, {0: 4}, {2: 5, 0: 3, 5: 7}, {1: 2, 3: 2}])
def test_versions_per_block(versions):
    s = Sequence(id=0, prompt=[], block_versions=dict(versions))
    assert s.oldest_version() == (min(versions.values()) if versions else None)
    expect = [versions.get(b, -1) for b in range(max(versions) + 1)] if versions else []
    assert s.versions_by_block() == expect


def test_new_block_resets_the_mbe_state_and_decodes():
    s = Sequence(id=0, prompt=[], status=MBE, block=1, mbe_start=0, mbe_passes=3, mbe_first_changed=1)
    s.new_block(4)
    assert (s.block, s.status, s.mbe_start, s.mbe_passes, s.mbe_first_changed) == (4, DECODING, None, 0, None)


def _pending(outcome):
    s = Sequence(id=7, prompt=[5, 6], status=WAITING)
    s.future = concurrent.futures.Future()
    s.future.set_running_or_notify_cancel()
    if isinstance(outcome, BaseException):
        s.future.set_exception(outcome)
    else:
        s.future.set_result(outcome)
    return s


@pytest.mark.parametrize("outcome", [("obs", 1.0, False, {}), None, ValueError("env broke")])
def test_pickled_sequence_keeps_its_pending_step_outcome(outcome):
    s = pickle.loads(pickle.dumps(_pending(outcome)))
    assert s.id == 7 and s.prompt == [5, 6] and s.status == WAITING
    assert s.future.done() and not s.future.cancelled()
    if isinstance(outcome, BaseException):
        with pytest.raises(ValueError, match="env broke"):
            s.future.result()
    else:
        assert s.future.result() == outcome
    assert "_step_outcome" not in s.__dict__


def test_pickled_sequence_without_a_step_has_no_future():
    s = pickle.loads(pickle.dumps(Sequence(id=1, prompt=[3], status=DECODING)))
    assert s.future is None and s.status == DECODING and "_step_outcome" not in s.__dict__


def test_pickled_sequence_leaves_its_turn_rule_behind():
    """The turn rule is the client's (it holds a tokenizer): the pickled sequence carries None, the adopting
    driver sets its own; every other field survives."""
    s = Sequence(id=4, prompt=[1, 2], status=WAITING, turn_rule=max, tag="g0")  # a picklable stand-in rule
    back = pickle.loads(pickle.dumps(s))
    assert back.turn_rule is None
    assert (back.id, back.prompt, back.status, back.tag) == (4, [1, 2], WAITING, "g0")
    assert s.turn_rule is max  # the original keeps its rule
