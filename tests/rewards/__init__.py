"""Tests of the reward functions and environments (rewards/), one file per module: rewards/x.py -> test_x.py."""
