"""``specdraft serve``: an OpenAI-compatible HTTP server with speculative decoding."""

from __future__ import annotations

import argparse
import os

from specdraft.commands import add_model_arguments, load_pipeline, port

HELP = "serve /v1/completions and /v1/chat/completions (OpenAI API) with speculative decoding"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000, help="0 picks a free port (printed on stderr)")
    p.add_argument(
        "--max-batch", type=int, default=16, help="requests decoded together (1 for non-Llama targets)"
    )
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a batch row before 429")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: --target)")
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="seconds in-flight requests may finish after SIGTERM",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require Authorization: Bearer KEY on /v1/* (default: $SPECDRAFT_API_KEY; none: no auth)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end a request still waiting or decoding after this long with a 408 (default: off)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=512,
        help="MB of earlier requests' keys and values kept for prompts that begin with the same tokens "
        "(a chat's earlier turns); 0: off",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$SPECDRAFT_API_KEY`` (unset or empty: no key)."""
    return args.api_key if args.api_key is not None else os.environ.get("SPECDRAFT_API_KEY") or None


def run(args: argparse.Namespace) -> int:
    from specdraft.server import ServerConfig, create_app, run_server

    config = ServerConfig(
        model_name=args.served_model_name or args.target,
        k=args.k,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens,
        shutdown_grace=args.shutdown_grace,
        api_key=api_key(args),
        request_timeout=args.request_timeout,
        prefix_cache_mb=args.prefix_cache_mb,
    )
    pipe = load_pipeline(args)
    return run_server(create_app(pipe, config), args.host, args.port, args.log_level)
