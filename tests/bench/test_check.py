"""`ebpo bench check`: passes on results like the baseline, fails when a ratio is broken (a doctored result,
or the decode benchmark run with the KV cache switched off on purpose), and names what failed."""
import json
from pathlib import Path

import pytest

from ebpo.bench import check

BASELINE = {"ratios": {
    "likelihood_cached_vs_loop": {"value": 4.5, "tol": 0.3},
    "replay_memory_vs_n1": {"value": 1.4, "tol": 0.15},
    "decode_cache_on_vs_off_batch32": {"value": 6.0, "tol": 0.3},
    "rewards_hang_overhead": {"value": 1.0, "tol": 0.5},
    "learner_budget_vs_padded": {"value": 1.75, "tol": 0.15},
}}


def _write(folder: Path, speedup: float, memory_ratio: float, cache32: float, hang_extra: float,
           budget: float = 1.7) -> None:
    (folder / "likelihood_0.json").write_text(json.dumps({"speed": {"speedup_cached_median": speedup}}))
    (folder / "memory_0.json").write_text(json.dumps({"memory": [
        {"mode": "direct", "cached": False, "ratio_vs_n1": 1.0},
        {"mode": "replay", "cached": True, "ratio_vs_n1": memory_ratio}]}))
    (folder / "decode_0.json").write_text(json.dumps({"ratios": {"m2t": {
        "batch32_over_batch1": 10.0, "cache_speedup_batch32": cache32, "cache_speedup_batch1": 1.5}}}))
    (folder / "rewards_0.json").write_text(json.dumps({"code_pool_per_s": 20.0, "code_serial_per_s": 15.0,
                                                       "hang_extra_s": hang_extra, "hang_timeout_s": 2.0}))
    (folder / "learner_0.json").write_text(json.dumps({"ratios": {"budget_vs_padded": 9.9,  # not the one guarded
                                                                  "budget_vs_padded_paired": budget}}))


@pytest.fixture()
def baseline(tmp_path):
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps(BASELINE))
    return path


def test_results_like_the_baseline_pass(tmp_path, baseline, capsys):
    _write(tmp_path, speedup=4.0, memory_ratio=1.5, cache32=5.0, hang_extra=2.1)
    assert check.main(["--results", str(tmp_path), "--baseline", str(baseline)]) == 0
    out = capsys.readouterr().out
    assert "within tolerance" in out and "no baseline for: decode_batch32_vs_batch1" in out


@pytest.mark.parametrize("broken,kwargs", [
    ("likelihood_cached_vs_loop", dict(speedup=3.0)),          # below 4.5 * 0.7 = 3.15
    ("replay_memory_vs_n1", dict(memory_ratio=1.7)),          # above 1.4 * 1.15 = 1.61 (lower is better)
    ("decode_cache_on_vs_off_batch32", dict(cache32=1.0)),    # the cache stopped helping
    ("rewards_hang_overhead", dict(hang_extra=3.2)),          # a hung call now costs 1.6 timeouts
    ("learner_budget_vs_padded", dict(budget=1.4)),           # below 1.75 * 0.85 = 1.49: the 1.5x target lost
])
def test_a_doctored_ratio_fails_and_is_named(tmp_path, baseline, capsys, broken, kwargs):
    _write(tmp_path, **{**dict(speedup=4.5, memory_ratio=1.4, cache32=6.0, hang_extra=2.0), **kwargs})
    out_json = tmp_path / "table.json"
    assert check.main(["--results", str(tmp_path), "--baseline", str(baseline), "--json", str(out_json)]) == 1
    assert f"FAILED: {broken} " in capsys.readouterr().out
    rows = {r["name"]: r for r in json.loads(out_json.read_text())}
    assert [n for n, r in rows.items() if r["ok"] is False] == [broken]


def test_tolerance_override_and_unknown_names(tmp_path, baseline):
    _write(tmp_path, speedup=4.0, memory_ratio=1.4, cache32=6.0, hang_extra=2.0)
    assert check.main(["--results", str(tmp_path), "--baseline", str(baseline), "--tol", "0.05"]) == 1  # 4.0 < 4.275
    with pytest.raises(SystemExit):
        check.main(["--results", str(tmp_path), "--only", "no_such_ratio"])


def test_committed_baseline_covers_every_ratio():
    data = json.loads(check.BASELINE.read_text())
    assert set(data["ratios"]) == {r.name for r in check.RATIOS}
    for name, entry in data["ratios"].items():
        assert entry["value"] > 0 and 0 < entry["tol"] < 1, name


@pytest.mark.slow
def test_breaking_the_decode_cache_on_purpose_fails_the_guard(tmp_path):
    """A real run (about 30 s): `--decode-set use_cache=false` turns the cache off in the 'cache on' rows too,
    so the cache ratios fall to about 1 and the guard exits 1; the batch ratio is still checked."""
    code = check.main(["--quick", "--only", "decode_cache_on_vs_off_batch32,decode_batch32_vs_batch1",
                       "--decode-set", "use_cache=false", "--json", str(tmp_path / "t.json")])
    rows = {r["name"]: r for r in json.loads((tmp_path / "t.json").read_text())}
    assert code == 1
    assert rows["decode_cache_on_vs_off_batch32"]["ok"] is False
    assert rows["decode_cache_on_vs_off_batch32"]["value"] < 1.5
