"""`python -m ebpo.model [--preset tiny]`: build a preset model and time one block-causal forward."""
import argparse
import time

import torch

from ebpo.model import LLaDA2MoeModelLM, load_preset, preset_names

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--preset", default="tiny", choices=preset_names())
parser.add_argument("--length", type=int, default=64)
args = parser.parse_args()
config = load_preset(args.preset)
model = LLaDA2MoeModelLM(config).eval()
ids = torch.randint(0, config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    start = time.perf_counter()
    logits = model(ids).logits
print(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
      f"logits {tuple(logits.shape)} in {1e3 * (time.perf_counter() - start):.1f} ms")
