"""The rollout engine as a long-lived service (`rollout.engine.Engine`): sequences with different decoding
settings share its forwards, `abort` frees a slot at once, and a long-lived engine forgets what it finished.

The reference for mixed settings is each sequence decoded alone with its own settings: by the plain-Python
reference decoder of tests/support/stub_engine_model.py (greedy rules), and by `generate` with one setting
for the sampled ones on the tiny model (a sequence's draws come from its own generator only)."""
import pytest
import torch

from tests.support.models import decoding_lm as make_model  # conftest.make_model; importable beside tests/serve
from rollout import DecodeConfig, generate
from rollout.engine import Engine
from rollout.sequence import FINISHED, QUEUED
from tests.support.stub_engine_model import StubModel, ref_single


K = 4


PROMPTS = [[3, 4, 5], [], [5, 6, 7, 8, 9, 3], [0] * 9, [7, 7, 7, 7], [4, 3], [9, 9, 8]]


MAX_NEW = [5, 8, 3, 11, 6, 7, 9]


# every per-request decision setting, several at once; all with the prefix cache (an engine-wide choice)
MIXED = [
    dict(max_post_steps=2),
    dict(tau_edit=None, num_to_transfer=2),
    dict(tau_mask=0.5, tau_edit=0.0, max_post_steps=1, early_commit=0.9),
    dict(max_post_steps=0),
    dict(max_post_steps=2, mbe_window=1, mbe_tau=0.7, mbe_max_passes=3),
    dict(max_post_steps=1, stop_at_eos=False),
    dict(max_post_steps=3, early_commit=0.7),
]


LEV_MIXED = [
    dict(max_post_steps=2, tau_delete=0.3, tau_insert=0.3, max_lev_edits=1),
    dict(tau_edit=None, max_post_steps=1, tau_delete=0.3),
    dict(max_post_steps=1, tau_insert=0.3, tau_delete=0.6, mbe_window=1, mbe_tau=0.7),
]


def _check_against_reference(stub, cfgs, max_batch):
    eng = Engine(stub, DecodeConfig.preset("quality"), max_batch=max_batch, canvas_len=6 * K)
    seqs = [eng.submit(p, max_new_tokens=m, config=c) for p, m, c in zip(PROMPTS, MAX_NEW, cfgs)]
    eng.run()
    for s, p, m, c in zip(seqs, PROMPTS, MAX_NEW, cfgs):
        rs = ref_single(stub, p, m, c)
        nb = rs.num_blocks
        assert s.status == FINISHED and s.cfg is c
        assert s.canvas == rs.x[:nb * K] and s.trace == rs.trace[:nb * K]
        assert (s.forwards, s.edits, s.mbe_edits, s.deletes, s.inserts) == (
            rs.forwards, rs.edits, rs.mbe_edits, rs.deletes, rs.inserts)
    return eng


@pytest.mark.parametrize("max_batch", [3, 7])
def test_mixed_settings_share_forwards_and_decode_like_each_alone(max_batch):
    """Seven sequences, each with other thresholds / post-steps / early commit / MBE / EOS rule / repetition
    penalty, decode in one engine exactly as the reference decodes each alone; with all admitted at once they
    share forwards (fewer model calls than the sum of their forwards)."""
    stub = StubModel(K=K, seed=1, eos_rate=0.12)
    cfgs = [DecodeConfig.preset("quality", **kw) for kw in MIXED]
    eng = _check_against_reference(stub, cfgs, max_batch)
    assert eng.num_forwards < sum(s.forwards for s in eng.sequences)
    assert eng.row_forwards == sum(s.forwards for s in eng.sequences)


def test_levenshtein_and_plain_settings_share_an_engine():
    """DELETE / INSERT rows and plain rows of a Levenshtein model share forwards, each as decoded alone."""
    stub = StubModel(K=K, seed=2, eos_rate=0.12, lev=True)
    kws = LEV_MIXED + LEV_MIXED + [LEV_MIXED[0]]
    _check_against_reference(stub, [DecodeConfig.preset("quality", **kw) for kw in kws], 4)


def test_sampling_settings_per_request_equal_each_setting_alone():
    """Four temperatures, top-k / top-p, the repetition penalty and two presets in one engine: every sequence's
    tokens equal `generate` with its own setting alone, from the same seed."""
    torch.set_num_threads(1)
    model = make_model(seed=3)
    settings = [DecodeConfig.preset(preset, temperature=t, top_k=tk, top_p=tp, repetition_penalty=rp,
                                    max_new_tokens=12)
                for preset, t, tk, tp, rp in [("quality", 0.6, 0, 1.0, 0.0), ("speed", 0.9, 5, 1.0, 0.0),
                                              ("quality", 1.2, 0, 0.8, 0.0), ("speed", 0.0, 0, 1.0, 3.0),
                                              ("speed", 0.6, 0, 1.0, 3.0), ("quality", 0.9, 0, 1.0, 0.0)]]
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17, 18, 19, 20], [21, 22], [23, 24, 25, 26]]
    eng = Engine(model, settings[0], max_batch=4, canvas_len=32)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]
    seqs = [eng.submit(p, g, config=c) for p, g, c in zip(prompts, gens, settings)]
    eng.run()
    for i, (s, p, c) in enumerate(zip(seqs, prompts, settings)):
        alone = generate(model, [p], c, seeds=[100 + i])[0]
        P = len(p)
        assert s.canvas[P:P + len(alone.token_ids)] == alone.token_ids, f"setting {i}"
        assert s.forwards == alone.num_forwards


def test_engine_wide_settings_are_refused_per_request():
    """The block size, the prefix cache and the compiled step are fixed per engine; a request that differs gets a
    ValueError naming the field; a compiled engine accepts only its own settings (max_new_tokens aside)."""
    stub = StubModel(K=K)
    eng = Engine(stub, DecodeConfig.preset("quality"), max_batch=2, canvas_len=16)
    with pytest.raises(ValueError, match="DecodeConfig.block_size"):
        eng.submit([3], config=DecodeConfig.preset("quality", block_size=8))
    with pytest.raises(ValueError, match="DecodeConfig.use_cache"):
        eng.submit([3], config=DecodeConfig.preset("quality", use_cache=False))
    with pytest.raises(ValueError, match="DecodeConfig.compiled_step"):
        eng.submit([3], config=DecodeConfig.preset("quality", compiled_step=True))
    with pytest.raises(ValueError, match="delete_token_id"):
        eng.submit([3], config=DecodeConfig.preset("quality", tau_delete=0.3))
    assert eng.queue == type(eng.queue)() and eng.sequences == []
    comp = Engine(stub, DecodeConfig.preset("quality", compiled_step=True), max_batch=2, canvas_len=16)
    comp.submit([3], config=DecodeConfig.preset("quality", compiled_step=True, max_new_tokens=3))
    with pytest.raises(ValueError, match="only max_new_tokens may differ"):
        comp.submit([3], config=DecodeConfig.preset("quality", compiled_step=True, tau_mask=0.5))


def test_abort_frees_the_slot_at_once_and_the_rest_decode_unchanged():
    """Aborting an active sequence frees its slot before the next forward (a queued one takes it) and aborting a
    queued one removes it; the others decode exactly as the reference."""
    stub = StubModel(K=K, seed=1, eos_rate=0.0)
    cfg = DecodeConfig.preset("quality", max_post_steps=2)
    eng = Engine(stub, cfg, max_batch=2, canvas_len=6 * K)
    seqs = [eng.submit(p, max_new_tokens=m) for p, m in zip(PROMPTS[:4], MAX_NEW[:4])]
    eng.step()
    assert [s.slot for s in seqs[:2]] == [0, 1] and seqs[2].status == QUEUED
    eng.abort(seqs[0])
    eng.abort(seqs[3])
    assert seqs[0].status == FINISHED and seqs[0].stop == "aborted" and seqs[0].forwards == 1
    assert seqs[3].status == FINISHED and seqs[3].stop == "aborted" and seqs[3].forwards == 0
    assert list(eng.queue) == [seqs[2]] and 0 in eng.free
    eng.step()
    assert seqs[2].slot == 0  # the freed slot took the queued sequence at the next forward
    eng.run()
    for s in (seqs[1], seqs[2]):
        rs = ref_single(stub, s.prompt, s.max_new, cfg)
        assert s.canvas == rs.x[:rs.num_blocks * K] and s.forwards == rs.forwards
    eng.abort(seqs[1])  # finished: nothing changes
    assert seqs[1].stop == ""


def test_a_long_lived_engine_forgets_finished_sequences_and_keeps_ids_unique():
    stub = StubModel(K=K, seed=1)
    eng = Engine(stub, DecodeConfig.preset("quality", max_post_steps=1), max_batch=2, canvas_len=6 * K)
    first = [eng.submit(p, max_new_tokens=4) for p in PROMPTS[:3]]
    eng.run()
    assert eng.forget_finished() == first and eng.sequences == []
    again = eng.submit(PROMPTS[0], max_new_tokens=4)
    assert again.id == 3 and eng.run() == [again]
    assert again.canvas == first[0].canvas
