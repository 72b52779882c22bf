"""/tokenize and /detokenize: the token ids of a text or a chat, and the text of ids, as vLLM's and llama.cpp's servers
answer them (clients count a prompt's tokens against the context before sending it). Requests take either server's
fields: a text as `prompt` (vLLM) or `content` (llama.cpp), a chat as `messages` (rendered by the model's template
with the assistant's turn opened, as a chat request's prompt is), and each server's switch for the tokenizer's BOS
with its default (`add_special_tokens`, on, with `prompt`; `add_special`, off, with `content`); a reply carries both
servers' keys (`count`, `max_model_len`, `tokens`; `prompt` and `content`)."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from imp_runtime.server.errors import bad_request
from imp_runtime.server.fields import get_bool, get_str, get_token_ids
from imp_runtime.server.openai_api import continue_final, parse_chat_messages
from imp_runtime.server.service import Service


async def tokenize(svc: Service, request: Request, body: dict):
    svc.check_model(body)
    given = [f for f in ("prompt", "content", "messages") if body.get(f) is not None]
    if len(given) != 1:
        raise bad_request("prompt", "give one of prompt (or content), a text, or messages, a chat"
                          + (f"; got {', '.join(given)}" if given else ""))
    if given[0] == "messages":
        if get_bool(body, "add_special_tokens") or get_bool(body, "add_special"):
            raise bad_request("add_special_tokens", "a chat's special tokens come from its template")
        ids = svc.encode_chat(parse_chat_messages(body), [], body=body, continue_final=continue_final(body))
    else:
        text = get_str(body, given[0], required=True)
        special = (get_bool(body, "add_special", False) if given[0] == "content"      # llama.cpp's default: no BOS
                   else get_bool(body, "add_special_tokens", True))                    # vLLM's: the tokenizer's BOS
        ids = svc.engine.tokenizer.encode(text, add_special_tokens=special)
    return JSONResponse({"count": len(ids), "max_model_len": svc.engine.max_context, "tokens": ids})


async def detokenize(svc: Service, request: Request, body: dict):
    svc.check_model(body)
    ids = get_token_ids(body, "tokens", svc.engine.bundle.spec.vocab_size, most=None, required=True)
    text = svc.engine.tokenizer.decode(ids, skip_special_tokens=False)
    return JSONResponse({"prompt": text, "content": text})
