"""Tests of the judge: rewards/judge.py (the parent's side), rewards/_judge.py and rewards/_judge_runner.py."""
