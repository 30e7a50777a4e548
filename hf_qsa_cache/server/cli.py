"""`hf-qsa-serve PATH`: serve one checkpoint of either family, text or multimodal, over OpenAI's HTTP API on our
classes and continuous-batching engine. Flags follow `transformers serve` where they mean the same.

The engine (the model and its manager) runs in a process of its own, which loads the checkpoint; this process
serves HTTP and relays tokens (`engine_process`). ``--engine-in-process`` keeps both in one process."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

API_KEY_ENV = "HF_QSA_API_KEY"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-qsa-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="the checkpoint: a folder saved by transformers (or a hub id in the local cache)")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="listen address (default: localhost only)")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", default=None,
                        help="the model name requests must use (default: the folder's name)")
    server.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every route but /health (or set {API_KEY_ENV})")
    server.add_argument("--enable-cors", action="store_true", help="permissive CORS (any origin)")
    server.add_argument("--log-level", default="warning")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds requests in flight may run on after a stop signal before they are cancelled")
    limits = p.add_argument_group("limits (checked before anything is queued: 4xx)")
    limits.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    limits.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the model's length less one")
    limits.add_argument("--max-tokens", type=int, default=4096, help="the most max_tokens a request may ask")
    limits.add_argument("--default-max-tokens", type=int, default=1024, help="max_tokens of a request that sets none")
    limits.add_argument("--max-n", type=int, default=8)
    model = p.add_argument_group("model")
    model.add_argument("--device", default="auto", help="'auto' (cuda if there is one), 'cpu', 'cuda', 'cuda:1'")
    model.add_argument("--dtype", default="auto", help="'auto' (the checkpoint's) or a torch dtype")
    model.add_argument("--chat-template-kwargs", default=None, help="JSON object passed to the chat template")
    model.add_argument("--torch-threads", type=int, default=None, help="torch's CPU threads")
    model.add_argument("--engine-in-process", action="store_true",
                       help="run the engine (model and manager) in the server's process, as one thread beside the "
                            "event loop (default: in a process of its own, so the two do not share one interpreter "
                            "lock)")
    cb = p.add_argument_group("continuous batching (always on; flags as in transformers serve)")
    cb.add_argument("--continuous-batching", action="store_true", help="accepted for transformers serve's command "
                    "lines: this server always batches continuously")
    cb.add_argument("--cb-block-size", type=int, default=None, help="tokens per cache block")
    cb.add_argument("--cb-num-blocks", type=int, default=None, help="blocks in the cache's main pool")
    cb.add_argument("--cb-max-batch-tokens", type=int, default=None, help="prefill tokens per step")
    cb.add_argument("--cb-max-requests", type=int, default=None, help="requests in flight (cache rows)")
    cb.add_argument("--cb-max-memory-percent", type=float, default=None,
                    help="accepted; this engine sizes its pool from --cb-num-blocks and the rows instead")
    cb.add_argument("--cb-use-cuda-graph", action=argparse.BooleanOptionalAction, default=None)
    cb.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="on a GPU, before listening: dummy requests compile the kernels of a whole prefill chunk and "
                         "record the decode step's CUDA graphs, which the first requests would otherwise wait for")
    cb.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="the attention K/V pages: the model's dtype, or fp8 e4m3 with a scale per token and head")
    cb.add_argument("--index-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="Qwen4Exp's QSA compressed index keys: the model's dtype, or fp8 e4m3")
    return p


def build(args):
    """(app, served) for parsed arguments. The engine is built, not started: `main` starts it before the server
    listens (else the app's startup does). By default it is an `EngineProcess` (the model loads in the engine's
    own process; this one reads only the config, generation config, tokenizer and processors); with
    ``--engine-in-process`` an `Engine` on a model loaded here."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, ContinuousBatchingConfig

    from .app import Limits, Served, build_app
    from .engine import Engine
    from .engine_process import EngineProcess, EngineSettings
    from .loading import default_model_name, load, load_generation_config, model_class, torch_dtype
    from .prompts import PromptBuilder

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    template_kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    if not isinstance(template_kwargs, dict):
        raise SystemExit("--chat-template-kwargs must be a JSON object")
    try:
        torch_dtype(args.dtype)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    cb = {"block_size": args.cb_block_size, "num_blocks": args.cb_num_blocks,
          "max_batch_tokens": args.cb_max_batch_tokens, "max_requests_per_batch": args.cb_max_requests,
          "max_memory_percent": args.cb_max_memory_percent, "use_cuda_graph": args.cb_use_cuda_graph}
    cb_config = ContinuousBatchingConfig(**{k: v for k, v in cb.items() if v is not None})
    fp8 = {"auto": None, "fp8": torch.float8_e4m3fn}
    cache_dtypes = {"kv_cache_dtype": fp8[args.kv_cache_dtype], "index_cache_dtype": fp8[args.index_cache_dtype]}
    if args.engine_in_process:
        model, tokenizer = load(args.path, args.device, args.dtype)
        config, generation_config = model.config, model.generation_config
        engine = Engine(model, generation_config, cb_config, cache_dtypes, warmup=args.warmup)
    else:
        config = AutoConfig.from_pretrained(args.path)
        generation_config = load_generation_config(args.path, config)
        tokenizer = AutoTokenizer.from_pretrained(args.path)
        level = getattr(logging, args.log_level.upper(), logging.WARNING)
        engine = EngineProcess(EngineSettings(args.path, args.device, args.dtype, generation_config, cb_config,
                                              cache_dtypes, args.torch_threads, level, args.warmup), config)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                    max_tokens=args.max_tokens, default_max_tokens=args.default_max_tokens, max_n=args.max_n)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    media_inputs = getattr(model_class(config), "media_inputs", ())
    served = Served(name=args.served_model_name or default_model_name(args.path), config=config,
                    generation_config=generation_config, tokenizer=tokenizer,
                    builder=PromptBuilder(args.path, config, tokenizer, template_kwargs, media_inputs),
                    engine=engine, limits=limits, api_key=api_key)
    return build_app(served, enable_cors=args.enable_cors), served


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    level = getattr(logging, args.log_level.upper(), logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as error:
        print(f"hf-qsa-serve needs the serve extra: pip install 'hf-qsa-cache[serve]' ({error})", file=sys.stderr)
        return 2
    from .engine import EngineDead
    from .loading import model_class

    app, served = build(args)
    if args.warmup:
        print("hf-qsa-serve: loading the model and warming the engine up (on a GPU the first start in a while compiles "
              "kernels: a minute or more at the released depths; --no-warmup skips it)", file=sys.stderr, flush=True)
    try:
        served.engine.start()  # before listening: the model loads, or the command exits saying why
    except EngineDead as error:
        print(f"hf-qsa-serve: {error}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1") and served.api_key is None:
        logging.getLogger(__name__).warning("listening on %s without an API key: anyone who reaches it may use it",
                                            args.host)
    where = "in this process" if served.engine.kind == "in-process" else f"in process {served.engine.process.pid}"
    print(f"hf-qsa-serve: {model_class(served.config).__name__} as {served.name!r} on http://{args.host}:{args.port} "
          f"(engine {where})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0
