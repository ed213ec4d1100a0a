"""ebpo: RL post-training (EBPO) for LLaDA2.x block-diffusion language models.

The sub-packages are the floors of the house (docs/architecture.md); a floor imports only those below it:

    ebpo.model   the LLaDA2-MoE transformer, its masks, presets, tokenizer and prefix KV cache
    ebpo.core    pure torch algorithms: noise, CPT/SFT objectives, block-ELBO likelihood, EBPO loss
    ebpo.infra   shared infrastructure: config loading, data, tracking, checkpoints, plots, process groups
    ebpo.sft     CPT/SFT training and held-out evaluation
    ebpo.rl      the Ray driver, learner, weight-sync driver, batch building, RL config
    ebpo.cli     the `ebpo` command;  ebpo.bench  the benchmarks

`rollout` (the decoder), `rewards` (reward functions) and `kernels` are top-level packages beside it.
"""
