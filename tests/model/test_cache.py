"""The prefix KV cache (ebpo.model.cache): cached block-by-block decoding equals a full recompute."""
import pytest
import torch

from ebpo.model import BlockKVCache, LLaDA2MoeModelLM, tiny_config
from ebpo.model.masks import block_causal_mask


def make_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return LLaDA2MoeModelLM(tiny_config(**overrides)).eval()


@pytest.mark.parametrize("block_size,prompt_lens", [(4, (5, 2)), (8, (3, 13)), (6, (7, 6))])
def test_cached_decoding_matches_full_recompute(block_size, prompt_lens):
    """Rows with different prefix lengths share a cache; each active block's logits equal a full forward."""
    model = make_model(block_size=block_size)
    K, total = block_size, 4 * block_size
    seqs = torch.randint(8, 100, (2, total))
    full = [model(seqs[r:r + 1], attention_mask=block_causal_mask(total, K)[None, None]).logits[0] for r in range(2)]
    cache = BlockKVCache.for_model(model.config, batch_size=2, max_len=total)
    with torch.no_grad():
        # Commit each row's complete prompt blocks (block-causal among them), row by row.
        for r, P in enumerate(prompt_lens):
            n = (P // K) * K
            if n:
                model(seqs[r:r + 1, :n], attention_mask=block_causal_mask(n, K)[None, None],
                      position_ids=torch.arange(n)[None], cache=cache, cache_rows=[r])
                cache.commit(n)
        # Then both rows advance together, one block at a time, each at its own absolute positions.
        for _ in range(2):
            starts = [cache.lengths[r] for r in range(2)]
            pos = torch.stack([torch.arange(s, s + K) for s in starts])
            ids = torch.stack([seqs[r, s:s + K] for r, s in enumerate(starts)])
            out = model(ids, position_ids=pos, cache=cache).logits
            for r, s in enumerate(starts):
                torch.testing.assert_close(out[r], full[r][s:s + K], atol=1e-5, rtol=1e-4)
            cache.commit(K)
