"""`ebpo serve`: the OpenAI-compatible server on the rollout engine.

    ebpo serve --model tiny-agent --port 8000
    ebpo serve --model DIR --mode speed --max-batch 32 --max-len 4096 --set tau_edit=0.3
    EBPO_API_KEY=secret ebpo serve --host 0.0.0.0        # beyond this machine: always with a key

Then any OpenAI client talks to it::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")  # the key, when the server has one
    r = client.chat.completions.create(model="tiny-agent", messages=[{"role": "user", "content": "Compute 482*37."}],
                                       extra_body={"mode": "quality", "return_token_ids": True})
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from rollout.config import PRESETS, DecodeConfig, parse_override

from .schema import DEFAULT_MAX_BODY_BYTES, DEFAULT_SHUTDOWN_GRACE_S

API_KEY_ENV = "EBPO_API_KEY"


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
    p.add_argument("--max-sequences", type=int, default=None,
                   help="most sequences (n per request, summed) the server holds at once; a request beyond it gets "
                        "429 with Retry-After (default: 4 x --max-batch)")
    p.add_argument("--max-len", type=int, default=1024, help="most tokens per sequence: prompt + max_tokens")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require `Authorization: Bearer KEY` on every route (default: ${API_KEY_ENV}; the "
                        "variable keeps the key out of the process list)")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2 ** 20,
                   help="largest request body read, in MiB (413 beyond it)")
    p.add_argument("--shutdown-grace-s", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   help="on SIGTERM, seconds requests in flight get to finish before they are answered 503")
    return p


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable only from this machine (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def build_service(model_spec: str, name: str | None = None, mode: str = "quality", overrides: dict | None = None,
                  max_batch: int = 16, max_len: int = 1024, device: str = "cpu", max_sequences: int | None = None):
    """(ChatService, EngineDriver started) for a model: what `ebpo serve` runs and what tests start in-process.
    max_sequences: the bound on sequences held at once (None: 4 x max_batch)."""
    from ebpo.model.loading import load_model, load_model_tokenizer

    from .driver import EngineDriver
    from .service import ChatService

    default = DecodeConfig.preset(mode, **(overrides or {}))
    model = load_model(model_spec, device=device).eval()
    tok = load_model_tokenizer(model_spec)
    driver = EngineDriver(model, tok, max_batch=max_batch, max_len=max_len, engine_config=default).start()
    return ChatService(model, tok, driver, name or model_spec, default, max_sequences=max_sequences), driver


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        overrides = dict(parse_override(s) for s in args.set)
        DecodeConfig.preset(args.mode, **overrides)
        if not (args.max_body_mb > 0 and args.shutdown_grace_s >= 0):
            raise ValueError("--max-body-mb must be > 0 and --shutdown-grace-s >= 0")
        if args.max_sequences is not None and args.max_sequences < 1:
            raise ValueError(f"--max-sequences must be >= 1, got {args.max_sequences}")
    except ValueError as err:
        print(f"ebpo serve: {err}", file=sys.stderr)
        return 2
    if not args.api_key and not is_loopback(args.host):
        print(f"ebpo serve: WARNING: listening on {args.host} without an API key: anyone who can reach this "
              f"port can run the model (set --api-key or ${API_KEY_ENV})", file=sys.stderr)
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    import uvicorn

    from .app import GracefulServer, create_app

    service, driver = build_service(args.model, args.name, args.mode, overrides, args.max_batch, args.max_len,
                                    args.device, args.max_sequences)
    app = create_app(service, api_key=args.api_key or None, max_body_bytes=int(args.max_body_mb * 2 ** 20))
    print(f"ebpo serve: {service.name!r} on http://{args.host}:{args.port}/v1 (max_batch {args.max_batch}, "
          f"max_sequences {service.max_sequences}, max_len {args.max_len}, default {args.mode}, "
          f"API key {'required' if args.api_key else 'none'})",
          file=sys.stderr)
    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"),
                            args.shutdown_grace_s)
    try:
        server.run()
    finally:
        driver.close(timeout=2.0)
    return 0
