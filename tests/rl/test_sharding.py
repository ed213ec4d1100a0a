"""How a learner group splits an RL batch (ebpo.rl.sharding): rows to ranks balanced by tokens, then token-budget
micro-batches.

* the plans are balanced, deterministic and cover every row;
* property tests (hypothesis) of the token-budget micro-batch plan (`token_microbatches`): every row exactly once,
  no micro-batch over the budget unless it is one row, and the plan's cost the minimum over every cut of the
  length-sorted rows into consecutive runs (brute force), ties to the fewest micro-batches."""
import itertools
from datetime import timedelta

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ebpo.rl.sharding import (MICROBATCH_OVERHEAD_TOKENS, balance_by_tokens, loss_weight, padded_lengths,
                              token_microbatches)


# bounded: a few seconds per test; no example database written into the tree
SETTINGS = settings(max_examples=300, deadline=timedelta(seconds=2), database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def plans(draw, max_rows=12):
    B = draw(st.integers(1, 16))
    tokens = torch.tensor(draw(st.lists(st.integers(1, 64), min_size=B, max_size=B)))
    rows = torch.tensor(draw(st.lists(st.integers(0, B - 1), min_size=0, max_size=max_rows, unique=True)),
                        dtype=torch.long)
    budget = draw(st.integers(-2, 400))
    return rows, tokens, budget


def _cost(mbs, tokens, overhead):
    return sum(len(m) * int(tokens[m].max()) + overhead for m in mbs)


@SETTINGS
@given(plans())
def test_every_row_once_and_no_micro_batch_over_budget(p):
    rows, tokens, budget = p
    mbs = token_microbatches(rows, tokens, budget)
    if budget <= 0 or len(rows) == 0:
        assert len(mbs) == 1 and torch.equal(mbs[0], rows)  # off: one micro-batch, original order
        return
    got = torch.cat(mbs).tolist()
    assert sorted(got) == sorted(rows.tolist()) and len(got) == len(rows)
    for m in mbs:
        assert len(m) >= 1
        assert len(m) == 1 or len(m) * int(tokens[m].max()) <= budget, (m.tolist(), budget)


@SETTINGS
@given(plans(max_rows=7), st.integers(0, 40))
def test_the_plan_costs_the_minimum_over_all_cuts(p, overhead):
    rows, tokens, budget = p
    if budget <= 0 or len(rows) == 0:
        return
    mbs = token_microbatches(rows, tokens, budget, overhead=overhead)
    order = sorted(rows.tolist(), key=lambda r: -int(tokens[r]))
    n, best, fewest = len(order), None, None
    for cuts in itertools.product([False, True], repeat=n - 1):  # a cut after position i or not
        runs, cur = [], [order[0]]
        for r, cut in zip(order[1:], cuts):
            if cut:
                runs.append(cur)
                cur = []
            cur.append(r)
        runs.append(cur)
        if any(len(m) > 1 and len(m) * max(int(tokens[r]) for r in m) > budget for m in runs):
            continue
        c = sum(len(m) * max(int(tokens[r]) for r in m) + overhead for m in runs)
        if best is None or c < best:
            best, fewest = c, len(runs)
        elif c == best:
            fewest = min(fewest, len(runs))
    assert _cost(mbs, tokens, overhead) == best
    assert len(mbs) == fewest  # ties go to fewer micro-batches


def test_default_overhead_is_positive():
    assert MICROBATCH_OVERHEAD_TOKENS > 0


def test_sharding_plans_are_balanced_deterministic_and_cover_every_row():
    tokens = torch.tensor([4, 32, 8, 28, 4, 16, 8, 20])
    rows = torch.tensor([5, 0, 7, 3, 1, 6, 2, 4])
    shares = balance_by_tokens(rows, tokens, 2)
    assert sorted(torch.cat(shares).tolist()) == sorted(rows.tolist())
    loads = [int(tokens[s].sum()) for s in shares]
    assert abs(loads[0] - loads[1]) <= int(tokens.max())  # greedy longest-first bound
    # every rank keeps the minibatch's own order of its rows
    for share in shares:
        pos = [rows.tolist().index(r) for r in share.tolist()]
        assert pos == sorted(pos)
    assert balance_by_tokens(rows, tokens, 1)[0] is rows
    micro = token_microbatches(rows, tokens, budget=40)
    assert sorted(torch.cat(micro).tolist()) == sorted(rows.tolist())
    for m in micro:  # within budget unless a single row is longer than it
        assert len(m) == 1 or len(m) * int(tokens[m].max()) <= 40
    assert token_microbatches(rows, tokens, 0)[0] is rows
    assert padded_lengths(torch.tensor([1, 4, 5]), 4).tolist() == [4, 4, 8]
    assert loss_weight(4, 4) == 1.0 and loss_weight(1, 4) == 0.25
