"""`ebpo serve`: the OpenAI-compatible server on the rollout engine.

    ebpo serve --model tiny-agent --port 8000
    ebpo serve --model DIR --mode speed --max-batch 32 --max-len 4096 --set tau_edit=0.3

Then any OpenAI client talks to it::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    r = client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": "Compute 482*37."}],
                                       extra_body={"mode": "quality", "return_token_ids": True})
"""
from __future__ import annotations

import argparse
import sys

from rollout.config import PRESETS, DecodeConfig, parse_override


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ebpo serve", description="OpenAI-compatible chat completions (and models) "
                                "on the rollout engine: concurrent requests share forwards (continuous batching).")
    p.add_argument("--model", default="tiny-agent", help="model folder, 'tiny-sft', 'tiny-agent' or 'preset:NAME'")
    p.add_argument("--name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=sorted(PRESETS), default="quality", help="default decoding preset")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the default DecodeConfig, e.g. --set max_new_tokens=128 (repeatable)")
    p.add_argument("--max-batch", type=int, default=16, help="most sequences decoding at once (per decode setting)")
    p.add_argument("--max-len", type=int, default=1024, help="most tokens per sequence: prompt + max_tokens")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    return p


def build_service(model_spec: str, name: str | None = None, mode: str = "quality", overrides: dict | None = None,
                  max_batch: int = 16, max_len: int = 1024, device: str = "cpu"):
    """(ChatService, EngineDriver started) for a model: what `ebpo serve` runs and what tests start in-process."""
    from ebpo.model.loading import load_model, load_model_tokenizer

    from .driver import EngineDriver
    from .service import ChatService

    default = DecodeConfig.preset(mode, **(overrides or {}))
    model = load_model(model_spec, device=device).eval()
    tok = load_model_tokenizer(model_spec)
    driver = EngineDriver(model, tok, max_batch=max_batch, max_len=max_len).start()
    return ChatService(model, tok, driver, name or model_spec, default), driver


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        overrides = dict(parse_override(s) for s in args.set)
        DecodeConfig.preset(args.mode, **overrides)
    except ValueError as err:
        print(f"ebpo serve: {err}", file=sys.stderr)
        return 2
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    import uvicorn

    from .app import create_app

    service, driver = build_service(args.model, args.name, args.mode, overrides, args.max_batch, args.max_len,
                                    args.device)
    print(f"ebpo serve: {service.name!r} on http://{args.host}:{args.port}/v1 (max_batch {args.max_batch}, "
          f"max_len {args.max_len}, default {args.mode})", file=sys.stderr)
    try:
        uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")
    finally:
        driver.close()
    return 0
