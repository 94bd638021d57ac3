"""`python -m nanovllm.serve MODEL [options]`: an OpenAI-compatible server over one engine."""
import argparse
import dataclasses
import logging
import os
import socket
import sys
import typing

from nanovllm.config import FIELD_NEEDS, Config

logger = logging.getLogger("nanovllm.serve")
ENGINE_FIELDS = [f for f in dataclasses.fields(Config) if f.init and f.name != "model"]
# Config.FIELD_NEEDS as flags, refused by argparse before the engine is imported
FLAGS = {"enable_lora=True": "--enable-lora", "kv_cache_dtype='fp8'": "--kv-cache-dtype fp8"}
NEEDS = {name: FLAGS[needs] for name, (needs, _) in FIELD_NEEDS.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """LLM's keywords as options (--max-model-len, --enforce-eager, ...) plus the server's."""
    p = argparse.ArgumentParser(prog="python -m nanovllm.serve",
                                description="Serve MODEL over OpenAI's HTTP API.")
    p.add_argument("model", help="checkpoint directory")
    engine = p.add_argument_group("engine (LLM's keywords)")
    for f in ENGINE_FIELDS:
        flag = "--" + f.name.replace("_", "-")
        shown = FIELD_NEEDS[f.name][1] if f.name in FIELD_NEEDS else f.default
        needs = f"; needs {NEEDS[f.name]}" if f.name in NEEDS else ""
        if bool in (f.type, *typing.get_args(f.type)):  # bool, or bool | None
            engine.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"default {'on' if shown else 'off'}{needs}")
        else:  # `int | None` (None: decided by the checkpoint) parses as int
            parse = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)
            engine.add_argument(flag, type=parse, default=f.default,
                                help=f"default {shown}{needs}")
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
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the server would ignore or only fail on after the model loads."""
    given = {"--enable-lora": args.enable_lora,
             "--kv-cache-dtype fp8": args.kv_cache_dtype == "fp8"}
    for f in ENGINE_FIELDS:
        if f.name in NEEDS and getattr(args, f.name) is not None and not given[NEEDS[f.name]]:
            p.error(f"--{f.name.replace('_', '-')} needs {NEEDS[f.name]}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port} is not a port number (0 to 65535)")
    for flag, value in (("--api-key (or $NANOVLLM_API_KEY)", args.api_key),
                        ("--served-model-name", args.served_model_name)):
        if value is not None and not value.strip():
            p.error(f"{flag} {value!r} is empty")
    if args.lora_modules:
        check_lora_modules(p, args)


def check_lora_modules(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--lora-modules: needs --enable-lora; unique names, none the base model's; directories."""
    from nanovllm.serve.openai.lora_modules import parse_lora_modules
    if not args.enable_lora:
        p.error("--lora-modules needs --enable-lora")
    try:
        parse_lora_modules(args.lora_modules)
    except ValueError as e:
        p.error(str(e))
    names = [spec.partition("=")[0] for spec in args.lora_modules]
    for spec, name in zip(args.lora_modules, names):
        path = spec.partition("=")[2]
        if names.count(name) > 1 or name == (args.served_model_name or args.model):
            p.error(f"--lora-modules {spec!r}: the name {name!r} is already served")
        if not os.path.isdir(os.path.expanduser(path)):
            p.error(f"--lora-modules {spec!r}: no adapter directory at {path!r}")


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
    try:  # bound before the engine starts, as vLLM does: a taken port fails in a second
        sock = listen_socket(args.host, args.port)
    except OSError as e:
        sys.exit(f"error: cannot listen on --host {args.host} --port {args.port}: {e}")
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
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    logger.info("serving %s on http://%s:%d", args.model, args.host, port)
    try:
        # On Ctrl-C uvicorn stops accepting, gives open streams a few seconds, then cancels
        # them (aborting their requests); the app's lifespan then stops the engine.
        config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                                timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C after the graceful stop: a clean exit, as uvicorn.run
        pass
    finally:
        llm.shutdown()


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), IPv4 or IPv6 as the host resolves; OSError if it cannot."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


if __name__ == "__main__":
    main()
