"""An OpenAI-compatible HTTP server over the engine's event stream.

- :mod:`~specdraft.server.protocol`: request models, response bodies, OpenAI-style errors.
- :mod:`~specdraft.server.scheduler`: the thread that owns the engine (continuous batching,
  per-request draft-length caps, cancellation, graceful shutdown).
- :mod:`~specdraft.server.metrics`: Prometheus metrics named after vLLM's.
- :mod:`~specdraft.server.app`: FastAPI routes, SSE streaming, and running uvicorn.

    from specdraft import api
    from specdraft.server import ServerConfig, create_app, run_server
    pipe = api.load("smollm2-135m", draft="prune:0,1,2,29")
    run_server(create_app(pipe, ServerConfig(model_name="smollm2-135m")), "127.0.0.1", 8000)
"""

from specdraft.server.app import ServerConfig, create_app, run_server

__all__ = ["ServerConfig", "create_app", "run_server"]
