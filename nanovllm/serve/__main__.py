"""`python -m nanovllm.serve MODEL [options]`: an OpenAI-compatible server over one engine."""
import argparse
import dataclasses
import logging
import os
import sys
import typing

from nanovllm.config import Config

logger = logging.getLogger("nanovllm.serve")
ENGINE_FIELDS = [f for f in dataclasses.fields(Config) if f.init and f.name != "model"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """LLM's keywords as options (--max-model-len, --enforce-eager, ...) plus the server's."""
    p = argparse.ArgumentParser(prog="python -m nanovllm.serve",
                                description="Serve MODEL over OpenAI's HTTP API.")
    p.add_argument("model", help="checkpoint directory")
    engine = p.add_argument_group("engine (LLM's keywords)")
    for f in ENGINE_FIELDS:
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            engine.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"default {'on' if f.default else 'off'}")
        else:  # `int | None` (None: decided by the checkpoint) parses as int
            parse = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)
            engine.add_argument(flag, type=parse, default=f.default, help=f"default {f.default}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the name clients ask for (default: MODEL)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) served under their names; needs "
                        "--enable-lora")
    p.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 (default: $NANOVLLM_API_KEY)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own (default), or with "
                        "--no-engine-process in a thread of the server's (sharing its GIL)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in ENGINE_FIELDS}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import uvicorn

        from nanovllm.serve.async_llm import AsyncLLM
        from nanovllm.serve.openai.app import build_app
        from nanovllm.serve.openai.lora_modules import parse_lora_modules
    except ImportError as e:
        sys.exit(f"serving needs the serve extra: pip install 'nanovllm[serve]' ({e})")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    try:
        lora_modules = parse_lora_modules(args.lora_modules)
        llm = AsyncLLM(args.model, engine_process=args.engine_process, **engine_kwargs(args))
    except ValueError as e:
        sys.exit(f"error: {e}")
    try:
        app = build_app(llm, args.served_model_name or args.model, args.api_key, lora_modules)
    except (ValueError, FileNotFoundError) as e:
        llm.shutdown()
        sys.exit(f"error: {e}")
    logger.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    try:
        # On Ctrl-C uvicorn stops accepting, gives open streams a few seconds, then cancels
        # them (aborting their requests); the app's lifespan then stops the engine.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
