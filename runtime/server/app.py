"""The HTTP app: routes, API-key auth, body limits, error shapes, request metrics.

Every API route goes through `_api(handler)`, which reads the body (refusing an oversized one), checks
the key, parses JSON, and turns an APIError, or any unexpected exception, into the dialect's error
shape, so no client ever sees a bare traceback or a hang.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import time
from importlib import resources

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from imp_runtime.server import anthropic_api, openai_api, responses_api, tokenize_api
from imp_runtime.server.errors import APIError, dialect_of, error_response
from imp_runtime.server.fields import parse_json_object
from imp_runtime.server.service import Service

log = logging.getLogger("imp.server")


def _key_ok(svc: Service, request: Request) -> bool:
    if not svc.api_key:
        return True
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    # compare_digest: the time taken does not reveal how much of a guess was right
    return given is not None and hmac.compare_digest(given.encode(), svc.api_key.encode())


async def _read_body(svc: Service, request: Request) -> bytes:
    limit = svc.limits.max_body_bytes
    too_big = APIError(413, f"body: the request body exceeds {limit} bytes", param="body",
                       code="request_too_large")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _check_content_type(request: Request) -> None:
    """Bodies are JSON and say so, as vLLM and llama.cpp's server require: a form post or a typo'd curl
    gets a 415 that says what to send, not a guess at what it meant."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(415, f"Content-Type: expected application/json, got {kind[:60] or 'none'}; "
                            "send the body as JSON with 'Content-Type: application/json'",
                       param="Content-Type", code="unsupported_media_type")


def _api(svc: Service, handler, endpoint: str, method_body: bool = True):
    async def route(request: Request) -> Response:
        request.state.t0 = time.perf_counter()
        dialect = dialect_of(request.url.path)
        try:
            if not _key_ok(svc, request):
                raise APIError(401, "invalid or missing API key: send Authorization: Bearer KEY or x-api-key: KEY",
                               code="invalid_api_key")
            if method_body:
                _check_content_type(request)
                body = parse_json_object(await _read_body(svc, request), svc.limits.max_json_depth)
                response = await handler(svc, request, body)
            else:
                response = await handler(svc, request)
        except APIError as e:
            response = error_response(e, dialect)
        except ClientDisconnect:
            response = Response(status_code=499)
        except Exception as e:  # a bug: log it, answer in the dialect's shape, keep serving
            log.exception("request failed")
            response = error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"), dialect)
        svc.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response
    return route


def create_app(svc: Service) -> Starlette:
    page = resources.files("imp_runtime.server").joinpath("chat.html").read_text()
    # anyio imports its asyncio backend on first use, which is the first streamed response's task group: that
    # import (~50 ms) was most of the extra time to first token of a server's first request. Do it now (unless an
    # event loop runs here already: then the first request still pays it).
    with contextlib.suppress(RuntimeError):
        anyio.run(anyio.sleep, 0)

    async def index(request: Request):
        return HTMLResponse(page)

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": svc.model, "executor": svc.engine.executor.name,
                             "running": len(svc.queue.running), "waiting": len(svc.queue.waiting)})

    async def metrics(request: Request):
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def not_found(request: Request, exc: HTTPException):
        e = APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                      f"{'no such endpoint' if exc.status_code == 404 else exc.detail}")
        return error_response(e, dialect_of(request.url.path))

    routes = [
        Route("/", index),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", _api(svc, openai_api.list_models, "/v1/models", method_body=False)),
        Route("/v1/models/{model:path}", _api(svc, openai_api.get_model, "/v1/models", method_body=False)),
        Route("/v1/chat/completions", _api(svc, openai_api.chat_completions, "/v1/chat/completions"), methods=["POST"]),
        Route("/v1/completions", _api(svc, openai_api.completions, "/v1/completions"), methods=["POST"]),
        Route("/v1/responses", _api(svc, responses_api.responses, "/v1/responses"), methods=["POST"]),
        Route("/v1/messages", _api(svc, anthropic_api.messages, "/v1/messages"), methods=["POST"]),
        Route("/v1/messages/count_tokens", _api(svc, anthropic_api.count_tokens, "/v1/messages/count_tokens"),
              methods=["POST"]),
        Route("/tokenize", _api(svc, tokenize_api.tokenize, "/tokenize"), methods=["POST"]),
        Route("/detokenize", _api(svc, tokenize_api.detokenize, "/detokenize"), methods=["POST"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        svc.close()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found}, lifespan=lifespan)
    if svc.limits.allowed_origins:
        # browser clients served from other origins (`impc serve --allowed-origins`): their preflights answered here,
        # before the routes (and the key check, which a preflight cannot pass: browsers send it without the key)
        app.add_middleware(CORSMiddleware, allow_origins=list(svc.limits.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])
    app.state.service = svc
    return app
