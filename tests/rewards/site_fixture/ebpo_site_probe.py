"""A module for the sandbox's site_packages test (made visible with code_reward(site_packages=[this dir]))."""
VALUE = 41
