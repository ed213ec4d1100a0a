"""Small random LLaDA2-MoE models shared by the tests, built without touching the global RNG."""
import torch

from ebpo.model import LLaDA2MoeModelLM, tiny_config

# one dense and one MoE layer, two query heads sharing one KV head: every code path of the model, in milliseconds
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=2,
             num_key_value_heads=1, block_size=4, initializer_range=0.2)


def small_lm(**overrides) -> LLaDA2MoeModelLM:
    """The `SMALL` model (fields overridden by `overrides`), fp32, in training mode, initialised from seed 0 inside
    a forked RNG so that building it changes no global random state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LLaDA2MoeModelLM(tiny_config(**{**SMALL, **overrides}))
