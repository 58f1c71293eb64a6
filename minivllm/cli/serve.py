"""`minivllm serve [MODEL]`: the OpenAI-compatible server (chapter 11).

    minivllm serve                      # the demo model on http://127.0.0.1:8000/v1
    minivllm serve /models/qwen3 --port 9000 --api-key secret --max-num-seqs 64

MODEL is a local Hugging Face folder or a .gguf file (the demo model when left out). Every
engine flag of `minivllm run` works here too; `--served-model-name` is the name clients send
as `model` (default: the folder's name, or the demo model's name).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from minivllm.engine.arg_utils import EngineArgs

    parser = subparsers.add_parser("serve", help="serve a model over the OpenAI API (FastAPI + uvicorn)")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="model folder or .gguf (default: the demo model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1 routes")
    parser.add_argument("--served-model-name", nargs="+", default=None, help="the name(s) clients use as `model`")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="API server processes sharing the port and one engine core (Linux)")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from minivllm.entrypoints.openai.api_server import run_server
    except ImportError as err:
        raise ValueError(f"the server needs its extra dependencies: pip install 'minivllm[serve]' ({err})") from None
    from minivllm.engine.arg_utils import AsyncEngineArgs
    from minivllm.engine.async_llm import AsyncLLM

    if args.model_tag is not None:
        args.model = args.model_tag
    engine_args = AsyncEngineArgs.from_cli_args(args)
    names = args.served_model_name or [default_model_name(engine_args.model)]
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    if args.api_server_count > 1:
        import os

        if not hasattr(os, "pidfd_open"):  # how an API process watches a core it did not start
            raise ValueError("--api-server-count above 1 needs Linux (5.3 or later)")
        from minivllm.entrypoints.openai.api_server import run_api_servers

        config = engine_args.create_engine_config()
        return run_api_servers(config, names, args.host, args.port, args.api_key, args.api_server_count)
    engine = AsyncLLM.from_engine_args(engine_args)
    run_server(engine, names, args.host, args.port, args.api_key)
    return 0


def default_model_name(model: str | None) -> str:
    if model is None:
        from minivllm.models.demo import DEMO_MODEL_NAME

        return DEMO_MODEL_NAME
    return Path(model).expanduser().resolve().name.removesuffix(".gguf")
