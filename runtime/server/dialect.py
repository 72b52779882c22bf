"""What the three API dialects (openai_api, responses_api, anthropic_api) share: reading message text and
tool lists, running jobs to completion for a non-streamed answer, and SSE framing with one guard that
turns any failure mid-stream into the dialect's error event (the status line has gone out by then)."""
from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Callable, Iterator, Protocol

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from imp_runtime.server.errors import APIError, bad_request
from imp_runtime.server.fields import get_list
from imp_runtime.server.queue import Job
from imp_runtime.server.service import Choice, Service
from imp_runtime.server.tools import Part, Tool

log = logging.getLogger("imp.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ------------------------------------------------------------------ reading requests


def text_of(v, where: str, part_types: tuple[str, ...] = ("text",), allow_null: bool = False) -> str:
    """A message's content: a string, or text parts joined by newlines (as vLLM does). `part_types` are
    the part types that carry text in the dialect (OpenAI's Responses API has input_text/output_text)."""
    if v is None:
        if allow_null:
            return ""
        raise bad_request(where, "this field is required")
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad_request(where, "expected a string or an array of content parts")
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict):
            raise bad_request(f"{where}[{j}]", "expected a content part object")
        kind = part.get("type")
        if kind not in part_types:
            raise bad_request(f"{where}[{j}].type", f"content of type {json.dumps(kind)} is not supported: "
                                                    "this model reads text only")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}[{j}].text", "expected a string")
        texts.append(text)
    return "\n".join(texts)


def nonempty_list(body: dict, name: str, what: str = "message") -> list:
    items = get_list(body, name, required=True)
    if not items:
        raise bad_request(name, f"at least one {what} is required")
    return items


def messages_of(body: dict, roles: tuple[str, ...]) -> Iterator[tuple[str, dict, str]]:
    """(field path, message, role) for each of `messages`, once it is an object with one of `roles`."""
    for i, m in enumerate(nonempty_list(body, "messages")):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(where, "expected a message object")
        role = m.get("role")
        if role not in roles:
            raise bad_request(f"{where}.role", f"expected {', '.join(roles[:-1])} or {roles[-1]}, "
                                               f"got {json.dumps(role)}")
        yield where, m, role


def check_tool_set(svc: Service, tools: list[Tool], schema_fields: list[str]) -> None:
    """Tool names are unique, and every tool's schema is one structured output can enforce (refused now,
    not when the tool is forced)."""
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools", "tool names must be unique")
    svc.check_tools(tools, schema_fields)


# ------------------------------------------------------------------ running


class PartSink(Protocol):
    """A dialect's builder of answer items (Anthropic's content blocks, the Responses API's items)."""

    def add(self, parts: list[Part], choice: Choice) -> None: ...


async def run_to_end(svc: Service, request: Request, jobs: list[Job], choices: list[Choice],
                     sink: PartSink | None = None) -> None:
    """Non-streamed: wait for every job and feed its tokens to its Choice (and the sink, if any)."""
    for choice, events in zip(choices, await svc.run_all(request, jobs)):
        for ev in events:
            parts = choice.add(ev)
            if sink is not None:
                sink.add(parts, choice)


# ------------------------------------------------------------------ streaming


def sse(data) -> str:
    """An unnamed SSE event (OpenAI's chat and completions streams)."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def named_sse(kind: str, data: dict) -> str:
    """A named SSE event (Anthropic's and the Responses API's streams)."""
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def block_events(svc: Service, job: Job, choice, builder) -> AsyncIterator[tuple[str, dict]]:
    """One choice's stream as (kind, data) events: each token's parts go to the dialect's builder (Anthropic's
    content blocks, the Responses API's output items), which says which events are final so far."""
    async for _, ev in svc.merged([job]):
        builder.add(choice.add(ev), choice)
        if ev.finish_reason:
            builder.finish()
        for item in builder.take_events():
            yield item


def event_stream(svc: Service, jobs: list[Job], events: AsyncIterator[str],
                 error_event: Callable[[APIError], str], last: str | None = None) -> StreamingResponse:
    """Stream `events`; a failure on the way (a failed generation, or a bug) ends the stream with the
    dialect's error event rather than a cut connection, and `last` (OpenAI's `[DONE]`) always closes it.
    However the response ends, the client having left included (even before the first event), the jobs
    are cancelled then, which frees their KV (a no-op for jobs that finished)."""
    async def guarded():
        try:
            async for chunk in events:
                yield chunk
        except APIError as e:
            yield error_event(e)
        except Exception as e:  # noqa: BLE001 - a bug: log it, tell the client, keep serving
            log.exception("stream failed")
            yield error_event(APIError(500, f"internal error: {type(e).__name__}: {e}"))
        finally:
            # the client may have left mid-stream: closing the events now (not whenever the garbage
            # collector gets to them) cancels their jobs and frees their KV at once
            await events.aclose()
        if last is not None:
            yield last
    return StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS,
                             background=BackgroundTask(svc.cancel, jobs))
