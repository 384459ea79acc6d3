"""The FastAPI app of `stemma serve`'s HTTP port (see native, completions, chat, dashboard).

Every route but /health and /metrics checks the API key when the server has one. Bodies over
the server's frame limit get a 413 before they are parsed.
"""
from __future__ import annotations

import json

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from stemma.serve.http import chat, completions, errors, native
from stemma.serve.http import generation as G
from stemma.serve.http.dashboard import dashboard_router
from stemma.serve.http.errors import ApiError, error_body
from stemma.serve.http.openai_models import (ChatCompletionRequest, CompletionRequest,
                                             DetokenizeRequest, EndProgramRequest, GenerateRequest,
                                             TokenizeRequest)
from stemma.serve.http.state import HttpState

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is refused with a 413."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                return await self._refuse(send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # FastAPI's body parser passes only HTTPException on
                    raise HTTPException(413, f"the request body is over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)

    async def _refuse(self, send):
        body = json.dumps(error_body(413, f"the request body is over {self.limit} bytes",
                                     code="too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def make_app(state: HttpState) -> FastAPI:
    app = FastAPI(title="stemma", version="0.1.0",
                  description="An OpenAI-compatible server over stemma's radix-cached engine.")
    errors.install(app)
    app.add_middleware(BodyLimit, limit=state.max_body_bytes)
    keyed = [Depends(state.auth)]

    @app.post("/v1/completions", dependencies=keyed)
    async def v1_completions(body: CompletionRequest, request: Request):
        state.check_ready()
        return await completions.create(state, body, request)

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def v1_chat_completions(body: ChatCompletionRequest, request: Request):
        state.check_ready()
        return await chat.create(state, body, request)

    @app.get("/v1/models", dependencies=keyed)
    async def v1_models():
        return native.models(state)

    @app.get("/v1/models/{model_id:path}", dependencies=keyed)
    async def v1_model(model_id: str):
        return native.model(state, model_id)

    @app.post("/generate", dependencies=keyed)
    async def generate(body: GenerateRequest, request: Request):
        state.check_ready()
        return await native.generate(state, body, request)

    @app.get("/get_server_info", dependencies=keyed)
    async def get_server_info():
        return await native.server_info(state)

    @app.post("/end_program", dependencies=keyed)
    async def end_program(body: EndProgramRequest):
        return native.end_program(state, body)

    @app.post("/flush_cache", dependencies=keyed)
    async def flush_cache():
        return await native.flush_cache(state)

    @app.post("/tokenize", dependencies=keyed)
    async def tokenize(body: TokenizeRequest):
        return await G.off_loop(native.tokenize, state, body)

    @app.post("/detokenize", dependencies=keyed)
    async def detokenize(body: DetokenizeRequest):
        return native.detokenize(state, body)

    @app.get("/health")
    async def health():
        try:
            state.check_ready()
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=503)
        return await native.health(state)

    @app.get("/metrics")
    async def metrics():
        return Response(content=state.metrics.render(), media_type=METRICS_TYPE)

    app.include_router(dashboard_router(state))
    return app

