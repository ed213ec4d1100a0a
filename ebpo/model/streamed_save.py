"""Write a Hugging Face model folder one shard at a time, from parts of a state dict as they arrive.

`save_pretrained(state_dict=...)` needs the whole state dict in memory at once. A sharded learner gathers
its weights bucket by bucket (`ebpo.rl.weight_stream`), so the exporter writes each bucket as one
safetensors shard and forgets it: the host never holds more than one bucket. The folder is what
`save_pretrained` writes (config.json, released weight names with per-expert tensors, `format: pt`
metadata) plus `model.safetensors.index.json` when there is more than one shard, which
`from_pretrained` reads.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping

import torch

_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def released_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Our name -> the released checkpoint's names: stacked routed experts `...mlp.experts.gate_proj`
    (E, F, H) become E tensors `...mlp.experts.{e}.gate_proj.weight`; every other tensor keeps its name."""
    prefix, _, leaf = name.rpartition(".")
    if leaf in _EXPERT_PROJS and prefix.endswith("mlp.experts") and tensor.dim() == 3:
        return [(f"{prefix}.{e}.{leaf}.weight", tensor[e].contiguous()) for e in range(tensor.shape[0])]
    return [(name, tensor.contiguous())]


def shard_name(index: int, count: int) -> str:
    """File name of shard `index` (0-based) of `count`, as transformers names them."""
    return "model.safetensors" if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def save_pretrained_streamed(config, path: str | Path, shards: Iterable[Mapping[str, torch.Tensor]],
                             num_shards: int) -> Path:
    """Write `config` and `num_shards` state-dict parts (CPU tensors, our parameter names) to `path`.

    shards: exactly `num_shards` mappings, each written to its own file as it is drawn from the iterable.
    Returns the folder. Raises ValueError if the iterable yields a different number of parts."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    weight_map: dict[str, str] = {}
    total = 0
    count = 0
    for part in shards:
        if count >= num_shards:
            raise ValueError(f"save_pretrained_streamed: more than the announced {num_shards} shards")
        file = shard_name(count, num_shards)
        tensors = dict(item for name, t in part.items() for item in released_tensors(name, t))
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
        count += 1
        del tensors, part
    if count != num_shards:
        raise ValueError(f"save_pretrained_streamed: got {count} shards, announced {num_shards}")
    if num_shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
