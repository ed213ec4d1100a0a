"""CPT/SFT training (`trainer`, configured by `config.SFTConfig`) and held-out evaluation (`evaluation`),
which the RL driver reuses for its periodic evals."""
