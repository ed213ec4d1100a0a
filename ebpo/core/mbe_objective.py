"""Multi-Block Editing window in SFT: T2T restoring across an enlarged bidirectional window.

At decode time an MBE pass (`rollout.decode.mbe_window = W`) runs the last W finished blocks and the block
that just ended as one enlarged block: each of their tokens attends all W+1 blocks (and the blocks before
them), no token is masked, and any token may be rewritten. The block-causal SFT objective never shows
the model that pattern (an earlier block never sees a later one), and the shipped models rewrite correct
tokens into garbage there (docs/rl.md, Multi-Block Editing). This term shows it:

* input: the clean sequence with a fraction `rate` of its response tokens substituted by random tokens
  (`ebpo.core.noise.t2t_substitute`), no masks (a finished window holds none);
* attention: block-causal over blocks of (W+1)K tokens whose boundaries are shifted by s whole K-blocks,
  s ~ U{0..W} once per batch, so that every alignment of a window on the K-block grid is trained (at decode
  a window starts at any block);
* loss: cross-entropy of the clean token at substituted positions (restore) plus `keep_weight` times at
  the other response positions (keep), each per token, as in the T2T stream of `ebpo.core.objectives`.

One plain forward of the (B, L) batch (no `[noisy ; clean]` copy: without masks the window needs no clean
context beyond what it sees itself). Randomness only from the generator passed in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ebpo.core.noise import t2t_substitute
from ebpo.model.masks import block_causal_mask_from_positions


def mbe_window_mask(length: int, block_size: int, window: int, shift: int, device=None) -> torch.Tensor:
    """(1, 1, L, L) bool keep-mask: block-causal over enlarged blocks of (window+1)*K tokens whose
    boundaries sit at K-block multiples offset by `shift` (0 <= shift <= window) blocks."""
    pos = (torch.arange(length, device=device) + shift * block_size)[None]
    return block_causal_mask_from_positions(pos, pos, (window + 1) * block_size)


def mbe_window_loss(model, lm_head, clean: torch.Tensor, response_mask: torch.Tensor, *, block_size: int,
                    window: int, rate: float, keep_weight: float, allowed_ids: torch.Tensor,
                    generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    """(restore + keep_weight * keep) of one batch through the enlarged window; clean/response_mask (B, L).

    Returns (loss scalar, metrics {loss/mbe_restore, loss/mbe_keep, acc/mbe_restore, mbe/shift}).
    """
    B, L = clean.shape
    shift = int(torch.randint(0, window + 1, (1,), generator=generator, device=generator.device))
    noisy, sub = t2t_substitute(clean.cpu(), response_mask.cpu(), rate, allowed_ids, generator)
    noisy, sub = noisy.to(clean.device), sub.to(clean.device)
    keep_pos = response_mask & ~sub
    keep = mbe_window_mask(L, block_size, window, shift, device=clean.device)
    out = model(input_ids=noisy, attention_mask=keep, position_ids=torch.arange(L, device=clean.device),
                return_logits=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def ce(select):
        if not select.any():
            return hidden.sum() * 0.0  # keeps the graph alive with no token
        return F.cross_entropy(lm_head(hidden[select]).float(), clean[select])

    restore, kept = ce(sub), ce(keep_pos)
    with torch.no_grad():
        acc = (lm_head(hidden[sub]).argmax(-1) == clean[sub]).float().mean() if sub.any() else torch.zeros(())
    metrics = {"loss/mbe_restore": float(restore.detach()), "loss/mbe_keep": float(kept.detach()),
               "acc/mbe_restore": float(acc), "mbe/shift": float(shift)}
    return restore + keep_weight * kept, metrics
