"""Online serving above the engine: an async engine loop, an OpenAI-compatible HTTP server (FastAPI +
uvicorn), Prometheus metrics, and `pagedkv serve`. See docs/serving.md.

    from pagedkv.serve.async_engine import AsyncEngine   # Engine -> async streams of outputs
    from pagedkv.serve.app import build_app               # AsyncEngine -> FastAPI app

Nothing is imported here eagerly: FastAPI and torch load only when a module that needs them is imported.
"""
