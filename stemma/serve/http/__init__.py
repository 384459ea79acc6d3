"""The HTTP front of `stemma serve`: OpenAI-compatible and native routes, Prometheus metrics and
the cache dashboard, served by uvicorn on a thread of the gateway process (see bridge)."""
