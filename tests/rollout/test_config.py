"""DecodeConfig (rollout/config.py), every rule of its docstring pinned on its own.

Each field: the values at the edges of what it accepts pass, the values just outside fail with the documented
message naming the field, the value and what it accepts; booleans are never numbers. Presets, `replace`,
`to_dict` and `parse_override` (every field's type, every spelling of a boolean and of None) likewise.
"""
import dataclasses

import pytest

from rollout.config import FIELD_NAMES, PRESETS, DecodeConfig, parse_override

NUM_ALLOWED = "None (off), a negative number (off) or a number in [0, 1]"
# field -> (accepted values, rejected values, the allowed-values text of its error)
RULES = {
    "block_size": ([None, 1, 7], [0, -1, True, 2.0], "None or an integer >= 1"),
    "max_new_tokens": ([1, 5], [0, -3, True, 4.0, None], "an integer >= 1"),
    "tau_mask": ([0, 0.0, 1, 1.0, 0.5], [-1e-9, 1.0 + 1e-9, True, "0.5", None], "a number in [0, 1]"),
    "tau_edit": ([None, -1, -0.5, 0.0, 1.0, 1], [1.0 + 1e-9, 2, True, False, "x"], NUM_ALLOWED),
    "max_post_steps": ([0, 3], [-1, 1.0, True], "an integer >= 0"),
    "num_to_transfer": ([1, 4], [0, -1, 2.0, True], "an integer >= 1"),
    "temperature": ([0, 0.0, 0.8, 5], [-1e-9, True, "1", None], "a number >= 0 (0 = greedy)"),
    "top_k": ([0, 20], [-1, 1.0, False, True], "an integer >= 0 (0 = off)"),
    "top_p": ([1.0, 1, 1e-9, 0.5], [0.0, 0, -0.1, 1.0 + 1e-9, True, None], "a number in (0, 1] (1 = off)"),
    "repetition_penalty": ([0, 0.0, 3.0], [-1e-9, True, None], "a number >= 0 (0 = off)"),
    "early_commit": ([None, 0, 0.0, 1, 1.0, 0.9], [-1e-9, 1.0 + 1e-9, True, False, "0.9"],
                     "None (off) or a number in [0, 1]"),
    "mbe_window": ([0, 2], [-1, 1.0, True], "an integer >= 0 (0 = off)"),
    "mbe_tau": ([0, 0.0, 1, 1.0], [-1e-9, 1.0 + 1e-9, True, None], "a number in [0, 1]"),
    "mbe_max_passes": ([1, 3], [0, -2, 1.0, True], "an integer >= 1"),
    "tau_delete": ([None, -1, 0.0, 1.0, 1], [1.0 + 1e-9, True, False, "0.3"], NUM_ALLOWED),
    "tau_insert": ([None, -1, 0.0, 1.0, 1], [1.0 + 1e-9, True, False, "0.3"], NUM_ALLOWED),
    "max_batch": ([0, 8], [-1, 2.0, True], "an integer >= 0 (0 = every prompt of a call at once)"),
    "max_lev_edits": ([1, 2], [0, -1, 1.0, True], "an integer >= 1"),
    "use_cache": ([True, False], [1, 0, "yes", None], "true or false"),
    "stop_at_eos": ([True, False], [1, 0, "no", None], "true or false"),
    "compiled_step": ([True, False], [1, 0, "true", None], "true or false"),
}
INT_FIELDS = {"block_size", "max_new_tokens", "max_post_steps", "num_to_transfer", "top_k", "mbe_window",
              "mbe_max_passes", "max_lev_edits", "max_batch"}
BOOL_FIELDS = {"use_cache", "stop_at_eos", "compiled_step"}


def test_every_field_has_a_rule():
    assert set(RULES) == set(FIELD_NAMES)


@pytest.mark.parametrize("name", sorted(RULES))
def test_accepted_values(name):
    for value in RULES[name][0]:
        cfg = DecodeConfig(**{name: value})
        assert getattr(cfg, name) == value and type(getattr(cfg, name)) is type(value)


@pytest.mark.parametrize("name", sorted(RULES))
def test_rejected_values_name_field_value_and_allowed(name):
    _, bad, allowed = RULES[name]
    for value in bad:
        with pytest.raises(ValueError) as err:
            DecodeConfig(**{name: value})
        assert str(err.value) == f"DecodeConfig.{name}: got {value!r}; allowed: {allowed}"


@pytest.mark.parametrize("name", sorted(RULES))
def test_replace_and_preset_validate_too(name):
    bad = RULES[name][1][0]
    with pytest.raises(ValueError, match=f"^DecodeConfig.{name}: "):
        DecodeConfig().replace(**{name: bad})
    with pytest.raises(ValueError, match=f"^DecodeConfig.{name}: "):
        DecodeConfig.preset("speed", **{name: bad})


def test_defaults_are_the_documented_ones():
    c = DecodeConfig()
    assert (c.block_size, c.max_new_tokens, c.tau_mask, c.tau_edit, c.max_post_steps, c.num_to_transfer) == \
        (None, 256, 0.7, 0.5, 16, 1)
    assert (c.temperature, c.top_k, c.top_p, c.repetition_penalty, c.early_commit) == (0.0, 0, 1.0, 0.0, None)
    assert (c.mbe_window, c.mbe_tau, c.mbe_max_passes, c.use_cache, c.stop_at_eos, c.compiled_step) == \
        (0, 0.9, 2, True, True, False)
    assert (c.max_batch, c.tau_delete, c.tau_insert, c.max_lev_edits) == (0, None, None, 2)


@pytest.mark.parametrize("tau,on", [(None, False), (-1e-9, False), (-1, False), (0.0, True), (0, True),
                                    (0.5, True), (1.0, True)])
def test_editing_and_levenshtein_properties(tau, on):
    assert DecodeConfig(tau_edit=tau).editing is on
    assert DecodeConfig(tau_delete=tau).levenshtein is on
    assert DecodeConfig(tau_insert=tau).levenshtein is on
    assert DecodeConfig(tau_delete=tau, tau_insert=None).levenshtein is on
    assert DecodeConfig(tau_delete=-1, tau_insert=tau).levenshtein is on
    assert DecodeConfig(tau_edit=tau).levenshtein is False  # T2T alone is not Levenshtein editing


def test_presets_are_the_documented_operating_points():
    want = {"quality": (0.7, 0.5, 16, True), "speed": (0.5, 0.0, 16, True), "m2t": (0.95, None, 16, False)}
    assert set(PRESETS) == set(want)
    base = dataclasses.asdict(DecodeConfig())
    for name, (tm, te, mps, editing) in want.items():
        c = DecodeConfig.preset(name)
        assert (c.tau_mask, c.tau_edit, c.max_post_steps, c.editing) == (tm, te, mps, editing)
        assert c.temperature == 0.0 and c.use_cache is True  # greedy, cache on
        others = {k: v for k, v in c.to_dict().items() if k not in ("tau_mask", "tau_edit", "max_post_steps")}
        assert others == {k: v for k, v in base.items() if k in others}


def test_preset_overrides_win_and_are_checked():
    c = DecodeConfig.preset("m2t", tau_mask=0.3, tau_edit=0.2, max_new_tokens=9)
    assert (c.tau_mask, c.tau_edit, c.max_new_tokens, c.max_post_steps) == (0.3, 0.2, 9, 16)
    with pytest.raises(ValueError) as err:
        DecodeConfig.preset("turbo")
    assert str(err.value) == "DecodeConfig.preset: unknown preset 'turbo'; choose one of ['m2t', 'quality', 'speed']"
    with pytest.raises(ValueError) as err:
        DecodeConfig.preset("quality", zeta=1, alpha=2, tau_mask=0.1)
    assert str(err.value) == f"DecodeConfig: unknown field(s) ['alpha', 'zeta']; fields are {list(FIELD_NAMES)}"


def test_replace_keeps_the_rest_and_checks_names():
    c = DecodeConfig.preset("speed", max_new_tokens=12)
    r = c.replace(top_k=5, temperature=0.5)
    assert r.to_dict() == {**c.to_dict(), "top_k": 5, "temperature": 0.5}
    assert c.top_k == 0  # the original is unchanged
    assert c.replace() == c
    with pytest.raises(ValueError) as err:
        c.replace(topk=5)
    assert str(err.value) == f"DecodeConfig: unknown field(s) ['topk']; fields are {list(FIELD_NAMES)}"


def test_to_dict_is_every_field():
    c = DecodeConfig(tau_delete=0.4, max_batch=3)
    d = c.to_dict()
    assert list(d) == list(FIELD_NAMES) and d["tau_delete"] == 0.4 and d["max_batch"] == 3
    assert DecodeConfig(**d) == c


@pytest.mark.parametrize("name", sorted(RULES))
def test_parse_override_types_follow_the_field(name):
    if name in BOOL_FIELDS:
        for raw, want in [("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
                          ("false", False), ("False", False), ("0", False), ("no", False), ("NO", False)]:
            key, value = parse_override(f"{name}={raw}")
            assert key == name and value is want
        with pytest.raises(ValueError) as err:
            parse_override(f"{name}=maybe")
        assert str(err.value) == f"override {name}: expected true/false, got 'maybe'"
        return
    key, value = parse_override(f" {name} = 3 ")
    assert key == name and value == 3 and type(value) is (int if name in INT_FIELDS else float)
    for raw in ("abc", "1e", ""):
        with pytest.raises(ValueError) as err:
            parse_override(f"{name}={raw}")
        assert str(err.value) == f"override {name}: {raw!r} is not a number"
    if name in INT_FIELDS:
        with pytest.raises(ValueError, match="is not a number"):
            parse_override(f"{name}=2.5")
    else:
        assert parse_override(f"{name}=0.25") == (name, 0.25)


@pytest.mark.parametrize("raw", ["none", "None", "NULL", "null", " none "])
def test_parse_override_none(raw):
    assert parse_override(f"tau_edit={raw}") == ("tau_edit", None)
    assert parse_override(f"use_cache={raw}") == ("use_cache", None)  # None for any field; validation judges it


def test_parse_override_malformed():
    for item in ("tau_mask", "=0.5", " =0.5", ""):
        with pytest.raises(ValueError) as err:
            parse_override(item)
        assert str(err.value) == f"override {item!r}: expected key=value"
    with pytest.raises(ValueError) as err:  # the first '=' splits: the rest is the value
        parse_override("top_p=0.5=1")
    assert str(err.value) == "override top_p: '0.5=1' is not a number"
    with pytest.raises(ValueError) as err:
        parse_override("tau=0.5")
    assert str(err.value) == f"DecodeConfig: unknown field(s) ['tau']; fields are {list(FIELD_NAMES)}"
