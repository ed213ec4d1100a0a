"""A block in which a model turn is followed by a later segment leaks, whatever follows that segment (issue 40:
the check missed [turn t ; answer t ; turn t + 1] in one block, since its latest segment is generated again)."""
import itertools

import pytest
import torch

from ebpo.core.likelihood import turn_response_mask
from ebpo.core.turns import leaking_blocks


def _plain(gen, seg):
    return any(g and any(t > s for t in seg) for g, s in zip(gen, seg))


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_every_one_block_layout_leaks_exactly_when_a_generated_token_has_a_later_segment_beside_it(K):
    """All one-block rows of K tokens whose segments are non-decreasing (0..3, right padding -1) and every
    generated pattern: leaking iff some generated token shares the block with a later segment."""
    for segs in itertools.product(range(-1, 4), repeat=K):
        real = [s for s in segs if s >= 0]
        if real != sorted(real) or (-1 in segs and any(s >= 0 for s in segs[segs.index(-1):])):
            continue
        for gen in itertools.product([False, True], repeat=K):
            if any(g and s < 0 for g, s in zip(gen, segs)):
                continue
            g, s = torch.tensor([gen]), torch.tensor([segs])
            want = _plain(gen, segs)
            assert bool(leaking_blocks(g, s, K)[0, 0]) == want, (gen, segs)
            if want:
                with pytest.raises(ValueError, match="row 0 block 0"):
                    turn_response_mask(g, s, K)


def test_a_turn_an_answer_and_the_next_turn_in_one_block_is_refused():
    gen = torch.tensor([[True, False, True, True]])
    seg = torch.tensor([[1, 2, 3, 3]])
    assert leaking_blocks(gen, seg, 4).tolist() == [[True]]
    with pytest.raises(ValueError, match="later segment"):
        turn_response_mask(gen, seg, 4)
