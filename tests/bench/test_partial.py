"""`ebpo bench partial`'s pure parts against plain counting: the staleness distribution from a version log,
step periods from wall-clock stamps, a configuration's summary, pooling rounds, speed-ups and the table."""
import statistics

import pytest

from ebpo.bench.partial import merge, shares, speedups, staleness_counts, step_periods, summarize, table


def test_staleness_shares_count_samples_per_lag_from_the_first_measured_step():
    log = [(1, 0, [0, 0, 0]), (2, 1, [0, 1, 0, 0]), (3, 2, [0, 1, 2, 2])]
    # steps 2 and 3: lags 1,0,1,1 and 2,1,0,0 -> lag 0: 3, lag 1: 4, lag 2: 1 of 8 samples
    assert shares(staleness_counts(log, first_step=2)) == {0: 3 / 8, 1: 4 / 8, 2: 1 / 8}
    assert list(staleness_counts(log, first_step=1)) == [0, 1, 2]  # lags ascending
    assert staleness_counts(log, first_step=1) == {0: 6, 1: 4, 2: 1}
    assert shares(staleness_counts(log, first_step=4)) == {}


def test_step_periods_are_differences_of_consecutive_stamps_after_the_first():
    assert step_periods({3: 10.5, 1: 2.0, 2: 7.0}) == [5.0, 3.5]
    assert step_periods({1: 1.0}) == []


def history(step, length, samples, carried, dropped):
    return {"step": step, "response_length/mean": length, "train/samples": samples,
            "partial/carried_token_share": carried, "partial/dropped": dropped, "timing_s/rollout": 1.0,
            "timing_s/update": 0.5, "response_length/max": 2 * length}


def test_summarize_weighs_the_carried_share_by_each_steps_tokens_and_leaves_the_warm_up_out():
    hist = [history(1, 100.0, 8, 0.9, 5), history(2, 10.0, 8, 1.0, 2), history(3, 30.0, 8, 0.0, 1)]
    r = summarize("p", [2.0, 4.0], hist, [(2, 1, [0] * 8), (3, 2, [2] * 8)], first_step=2)
    assert r["carried_token_share"] == pytest.approx(80 / 320)  # 80 of the 80 + 240 tokens of steps 2-3
    assert r["trained_tokens_per_s"] == pytest.approx(320 / 6.0)
    assert (r["period_median_s"], r["period_mean_s"], r["dropped"]) == (3.0, 3.0, 3)
    assert r["staleness"] == {0: 0.5, 1: 0.5}
    assert r["response_length_max"] == 60.0


def test_merge_pools_the_rounds_as_one_longer_run_would():
    hist_a = [history(1, 1.0, 4, 0.0, 0), history(2, 10.0, 4, 0.5, 1)]
    hist_b = [history(1, 1.0, 4, 0.0, 0), history(2, 30.0, 4, 0.0, 3), history(3, 20.0, 4, 1.0, 0)]
    a = summarize("p", [1.0], hist_a, [(2, 1, [1, 1, 1, 0])], 2)
    b = summarize("p", [3.0, 5.0], hist_b, [(2, 1, [0] * 4), (3, 2, [2] * 4)], 2)
    m = merge([a, b])
    tokens = 40 + 120 + 80
    assert m["steps"] == 3 and m["periods_s"] == [1.0, 3.0, 5.0]
    assert m["period_median_s"] == statistics.median([1.0, 3.0, 5.0]) and m["period_mean_s"] == 3.0
    assert m["trained_tokens_per_s"] == pytest.approx(tokens / 9.0)
    assert m["carried_token_share"] == pytest.approx((20 + 80) / tokens)
    # 12 samples: lags 0,0,0,1 in round a; 1,1,1,1 then 0,0,0,0 in round b
    assert m["staleness_counts"] == {0: 7, 1: 5} and m["staleness"] == pytest.approx({0: 7 / 12, 1: 5 / 12})
    assert m["dropped"] == 4 and merge([a]) is a


def test_speedups_and_the_table_name_every_configuration():
    runs = [{"config": c, "period_median_s": m, "period_mean_s": m + 1, "trained_tokens_per_s": 10.0,
             "carried_token_share": 0.25, "staleness": {"0": 0.5, "1": 0.25, "2": 0.2, "3": 0.05}, "dropped": 2.0,
             "rollout_s": 1.0, "update_s": 0.5, "trained_samples_per_step": 8.0, "tool_s_per_trajectory": 0.0}
            for c, m in (("sync", 8.0), ("max_staleness=1", 4.0), ("max_staleness=1 + partial", 2.0))]
    s = speedups(runs)
    assert s["speedup_partial_vs_s1"] == 2.0 and s["speedup_s1_vs_sync"] == 2.0
    assert s["speedup_partial_vs_s1_mean"] == pytest.approx(5 / 3)
    assert speedups(runs[:1]) == {}
    res = {"runs": runs, "steps": 6, "rounds": 2,
           "workload": {"name": "long-tail", "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 128}}
    t = table(res)
    assert [c.header for c in t.columns][0] == "configuration" and t.row_count == 3
    cells = [list(c.cells) for c in t.columns]
    assert cells[0] == ["sync", "max_staleness=1", "max_staleness=1 + partial"]
    assert cells[7][0] == "50%/25%/25%"  # lags 2 and 3 pooled as 2+
    # seconds per 8 trained samples: a partial step that trained 16 in 3 s takes 1.5 s per 8
    assert cells[3] == ["9.00", "5.00", "3.00"]
    runs[2]["trained_samples_per_step"] = 16.0
    assert speedups(runs, batch=8)["speedup_partial_vs_s1_per_batch"] == pytest.approx(5.0 / 1.5)
    assert "speedup_partial_vs_s1_per_batch" not in speedups(runs)
    runs.append(dict(runs[2], config="max_staleness=1 + partial (drop)", period_median_s=1.0))
    assert speedups(runs)["speedup_partial_drop_vs_s1"] == 4.0
    res["workload"] = {"name": "slow-tools", "prompts_per_step": 4, "group_size": 2, "slow_s": 4.0, "fast_s": 0.05,
                       "slow_share": 0.25}
    assert "tools 4 s in 25% of episodes" in str(table(res).title)


def test_slow_tool_episodes_are_a_fixed_hash_of_prompt_and_seed_at_the_asked_share():
    from ebpo.bench.slow_tools import is_slow, slow_calculator

    pairs = [(f"Compute {i}*7.", seed) for i in range(400) for seed in range(10)]
    slow = [is_slow(p, s, 0.25) for p, s in pairs]
    # 4000 independent-looking uniforms: the share is within 5 binomial standard deviations (0.034) of 0.25
    assert abs(sum(slow) / len(slow) - 0.25) < 5 * (0.25 * 0.75 / len(pairs)) ** 0.5
    assert slow == [is_slow(p, s, 0.25) for p, s in pairs]  # a pure function of (prompt, seed)
    assert not any(is_slow(p, s, 0.0) for p, s in pairs) and all(is_slow(p, s, 1.0) for p, s in pairs)
    env = slow_calculator(slow_s=3.0, fast_s=0.5, slow_share=0.25)
    for (p, s), want in zip(pairs[:50], slow[:50]):
        env.reset({"prompt": p}, s)
        assert env.latency_s == (3.0 if want else 0.5)
    for bad in ({"slow_s": -1.0}, {"fast_s": -0.1}, {"slow_share": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            slow_calculator(**bad)
