"""`ebpo generate`: prompts in, text out, with the draft-and-edit decoder.

    ebpo generate --prompt "12+7=" --mode quality
    ebpo generate --prompts-file prompts.txt --mode speed --set max_new_tokens=64 --json
    ebpo generate --prompt "hello" --chat --show          # watch the canvas fill and edit
    ebpo generate --prompt "hi" --temperature 0.8 --seed 3 --set top_p=0.9
    ebpo generate --model DIR --chat --prompt "Compute 482*37." --env calculator --show   # turns, tool calls
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .config import PRESETS, DecodeConfig, parse_override


def _parser(parents: tuple = ()) -> argparse.ArgumentParser:
    """The options; `parents` (argparse parsers made with add_help=False) add theirs to the same --help
    (`ebpo.cli.generate` adds --env, --env-kwargs and --multiturn)."""
    p = argparse.ArgumentParser(prog="ebpo generate", description="Draft-and-edit decoding of LLaDA2.x models.",
                                parents=list(parents))
    p.add_argument("--model", default=None,
                   help="model folder, 'tiny-sft' or 'preset:NAME[@seed]' (default: the shipped tiny checkpoint, "
                        "else a randomly initialised tiny model)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="a text file with one prompt per line")
    p.add_argument("--mode", choices=sorted(PRESETS), default="quality", help="decoding preset")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a DecodeConfig field, e.g. --set tau_edit=0.3 (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="> 0 samples (default: greedy)")
    p.add_argument("--seed", type=int, default=0, help="sequence i uses seed + i")
    p.add_argument("--chat", action="store_true", help="wrap each prompt with the tokenizer's chat template")
    p.add_argument("--show", action="store_true", help="live view of the canvas as it fills and edits")
    p.add_argument("--delay", type=float, default=0.05, help="seconds between --show frames")
    p.add_argument("--json", action="store_true", help="print one JSON object per sequence")
    p.add_argument("--device", default="cpu")
    return p


def _load(spec: str | None, device: str):
    from ebpo.model.loading import TINY_SFT_DIR, load_model, load_model_tokenizer

    if spec is None:
        if (TINY_SFT_DIR / "config.json").exists():
            spec = "tiny-sft"
        else:
            print("ebpo generate: warning: no shipped tiny checkpoint found; using a randomly initialised "
                  "tiny model (output is noise). Pass --model DIR.", file=sys.stderr)
            spec = "preset:tiny"
    model = load_model(spec, device=device).eval()
    return model, load_model_tokenizer(spec)


def _prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise SystemExit(f"ebpo generate: --prompts-file {path} does not exist")
        prompts += [line.rstrip("\n") for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit("ebpo generate: give at least one --prompt or a --prompts-file")
    return prompts


def main(argv: list[str], env_factory=None, multiturn: dict | None = None, parents: tuple = ()) -> int:
    """`ebpo generate`; with `env_factory` (a no-argument callable building one environment: `ebpo.cli.generate`
    passes it for `--env`), each prompt is a multi-turn rollout (`rollout.multiturn`). parents: parsers whose
    options were already taken from `argv` by the caller, listed in --help."""
    args = _parser(parents).parse_args(argv)
    try:
        overrides = dict(parse_override(s) for s in args.set)
        if args.max_new_tokens is not None:
            overrides["max_new_tokens"] = args.max_new_tokens
        if args.temperature is not None:
            overrides["temperature"] = args.temperature
        config = DecodeConfig.preset(args.mode, **overrides)
    except ValueError as err:
        print(f"ebpo generate: {err}", file=sys.stderr)
        return 2
    texts = _prompts(args)
    model, tok = _load(args.model, args.device)
    if args.chat:
        tools = _env_tools(env_factory) if env_factory is not None else None
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], tools=tools, add_generation_prompt=True,
                                         tokenize=False) for t in texts]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    seeds = [args.seed + i for i in range(len(ids))]

    from .decoder import generate

    if env_factory is not None:
        return _multiturn(args, model, tok, texts, ids, seeds, config, env_factory, multiturn or {})
    if args.show:
        from .show import CanvasView

        with CanvasView(tok, model.config.mask_token_id, delay=args.delay) as view:
            outs = generate(model, ids, config, tokenizer=tok, seeds=seeds, on_step=view.update)
    else:
        outs = generate(model, ids, config, tokenizer=tok, seeds=seeds)
    for prompt, out in zip(texts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, **dataclasses.asdict(out)}))
        elif not args.show:
            print(out.text)
        else:
            lev = f", deletes {out.num_deletes}, inserts {out.num_inserts}" if config.levenshtein else ""
            print(f"{out.text!r}  (forwards {out.num_forwards}, TPF {out.tpf:.2f}, edits {out.num_edits}{lev})")
    return 0


def _env_tools(env_factory) -> list[dict] | None:
    """The tool specs of the environment `env_factory` builds (`env.specs`, None without tools), for the chat
    template's `tools=` argument: multi-turn prompts list the tools as RL and `ebpo eval --env` do."""
    env = env_factory()
    try:
        specs = getattr(env, "specs", None)
        return list(specs) if specs else None
    finally:
        if callable(getattr(env, "close", None)):
            env.close()


def _multiturn(args, model, tok, texts, ids, seeds, config, env_factory, multiturn: dict) -> int:
    """Multi-turn rollouts of the prompts; `--show` renders each trajectory's turns, tool calls and results."""
    from .multiturn import MultiTurnConfig, generate_multiturn, start_episodes

    mt = MultiTurnConfig(**multiturn)
    envs = [env_factory() for _ in ids]
    prompts = start_episodes(envs, [{"prompt": t} for t in texts], ids, tok, seeds, mt.observation_template)
    trajs = generate_multiturn(model, prompts, envs, config, mt, tokenizer=tok,
                               seeds=seeds if config.temperature > 0 else None)
    if args.show:
        from rich.console import Console

        from .show import render_trajectory

        for tr in trajs:
            Console().print(render_trajectory(tr.to_dict(), tok))
    for tr in trajs:
        if args.json:
            print(json.dumps(tr.to_dict()))
        elif not args.show:
            print(tr.turns[-1].text if tr.turns else "")
    return 0
