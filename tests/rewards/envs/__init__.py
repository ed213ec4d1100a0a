"""Tests of rewards/envs/, one file per module: rewards/envs/x.py -> test_x.py."""
