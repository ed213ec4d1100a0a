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


def decoding_lm(seed: int = 0, head_scale: float = 8.0, eos_boost: float = 0.0) -> LLaDA2MoeModelLM:
    """The random tiny preset model of the decoding tests, in eval mode, its lm_head scaled up so that confidences
    spread across the thresholds; eos_boost > 0 shifts the EOS logit up so that sequences stop early. Built from
    `seed` inside a forked RNG (no global random state changes)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LLaDA2MoeModelLM(tiny_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        if eos_boost:
            h = model.lm_head.weight.shape[1]
            model.lm_head.weight[model.config.eos_token_id] += eos_boost / h ** 0.5
    return model
