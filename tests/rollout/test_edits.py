"""Edit precision: `rollout.edits.edit_counts` on a hand-built trace, the decoder's edit log against the canvases its
`on_step` events show, and the evaluation metrics built from both.

Edit precision counts against their plain rule, on classes of inputs."""
import math
import random

import pytest

from ebpo.sft.evaluation import EvalResult
from rollout import DecodeConfig, generate
from rollout.edits import EditCounts, edit_counts, edit_metrics


def test_edit_counts_on_a_hand_built_trace():
    reference = [10, 11, 12, 13, 1]  # "correct" completion, EOS = 1
    log = [(0, 20, 10),   # fix: wrong -> reference
           (1, 11, 21),   # break: reference -> wrong
           (1, 21, 11),   # fix: the broken token restored
           (2, 30, 31),   # neutral: wrong -> another wrong
           (4, 13, 1),    # fix: EOS written where the reference ends
           (7, 5, 6)]     # past the reference: counted as an edit only
    c = edit_counts(log, reference)
    assert (c.edits, c.fixes, c.breaks) == (6, 3, 1)
    assert c.precision == 0.75
    assert math.isnan(EditCounts().precision)
    assert edit_counts([], reference) == EditCounts(0, 0, 0)


def test_edit_metrics_sum_over_rows_per_task():
    counts = [EditCounts(4, 3, 1), EditCounts(2, 0, 2), None, EditCounts(1, 1, 0)]
    m = edit_metrics(["math", "math", "math", "code"], counts, "eval/")
    assert m["eval/math/edit_precision"] == 3 / 6  # summed: 3 fixes, 3 breaks (the row without reference skipped)
    assert m["eval/math/edits_per_seq"] == 3.0 and m["eval/math/breaks_per_seq"] == 1.5
    assert m["eval/code/edit_precision"] == 1.0
    r = EvalResult("speed", ["math", "math"], [1.0, 0.0], tokens=10, forwards=5, edits=6, wall_s=1.0,
                   edit_counts=counts[:2])
    assert r.metrics("eval/")["eval/math/fixes_per_seq"] == 1.5


def test_decoder_edit_log_matches_the_canvases_of_its_steps(model):
    """Every rewrite the step events show (a visible token replaced) is in the log, in order, with its old
    and new token; the log's length is num_edits. MBE passes included."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    for cfg in [DecodeConfig.preset("speed", max_new_tokens=24, temperature=1.0),
                DecodeConfig.preset("speed", max_new_tokens=24, temperature=1.0, mbe_window=1, mbe_tau=0.3)]:
        last: dict[int, list[int]] = {}
        seen: dict[int, list[tuple[int, int, int]]] = {0: [], 1: []}
        mask = model.config.mask_token_id

        def on_step(ev):
            prev = last.get(ev.seq)
            for p in ev.edited:
                assert prev is not None and prev[p] != mask
                seen[ev.seq].append((p - ev.prompt_len, prev[p], ev.canvas[p]))
            last[ev.seq] = ev.canvas

        outs = generate(model, prompts, cfg, seeds=[1, 2], on_step=on_step)
        assert sum(o.num_edits for o in outs) > 0, "the check needs some edits"
        for i, o in enumerate(outs):
            assert o.edit_log == seen[i] and len(o.edit_log) == o.num_edits
            assert all(old != new for _, old, new in o.edit_log)


@pytest.mark.parametrize("seed", range(6))
def test_edit_counts_match_the_documented_rule_for_every_offset(seed):
    """Every offset from before the reference to past its end (the end itself included), tokens drawn from a
    tiny alphabet so that fixes, breaks and neutral edits (wrong -> other wrong) all occur."""
    rng = random.Random(seed)
    ref = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
    log = [(rng.randint(-2, len(ref) + 2), rng.randrange(3), rng.randrange(3)) for _ in range(40)]
    log += [(len(ref), ref[-1], ref[-1] + 1)]  # exactly one past the end: an edit, never a fix or a break
    fixes = breaks = 0
    for off, old, new in log:
        if 0 <= off < len(ref):
            fixes += old != ref[off] and new == ref[off]
            breaks += old == ref[off] and new != ref[off]
    assert edit_counts(log, ref) == EditCounts(len(log), fixes, breaks)


def test_neutral_edits_are_neither_fixes_nor_breaks():
    ref = [5, 6, 7]
    assert edit_counts([(0, 1, 2), (1, 3, 4), (2, 8, 9)], ref) == EditCounts(3, 0, 0)


def test_edit_metrics_default_prefix_is_eval():
    m = edit_metrics(["math"], [EditCounts(2, 1, 1)])
    assert m == {"eval/math/edit_precision": 0.5, "eval/math/edits_per_seq": 2.0, "eval/math/fixes_per_seq": 1.0,
                 "eval/math/breaks_per_seq": 1.0}
