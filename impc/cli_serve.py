"""`impc serve BUNDLE`: the HTTP server (OpenAI and Anthropic APIs, metrics, chat page) on uvicorn."""
from __future__ import annotations

import os
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a bundle over HTTP (OpenAI and Anthropic APIs)",
                       description="Load a bundle and answer OpenAI (/v1/chat/completions, /v1/completions, "
                                   "/v1/responses, /v1/models) and Anthropic (/v1/messages) requests, and /tokenize, /detokenize. "
                                   "GET / is a chat page; /metrics is Prometheus; /health needs no key.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=os.environ.get("IMP_API_KEY"),
                   help="require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                        "(default: $IMP_API_KEY; none: open)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-n", type=int, default=8, metavar="N", help="most choices per request (default 8)")
    p.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="generations interleaved at once; later requests queue (default: the bundle's largest "
                        "decode batch, 64 unless compiled otherwise)")
    p.add_argument("--max-step-tokens", type=int, default=None, metavar="N",
                   help="tokens one step computes at most: a row per running generation plus prompt tokens "
                        "(smaller: steadier inter-token latency while prompts arrive; larger: prompts taken in "
                        "faster; default: the bundle's prefill chunk)")
    p.add_argument("--max-body-mb", type=float, default=4.0, metavar="MB", help="largest request body (default 4)")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="origins (https://host:port, or '*') whose browser pages may call the API: cross-origin "
                        "requests get CORS headers, as vLLM's --allowed-origins (which defaults to '*'; here none, "
                        "so a web page cannot drive a local server unless you say so); the chat page at / is "
                        "same-origin and needs none")
    p.add_argument("--reasoning-parser", choices=["auto", "none"], default="auto",
                   help="auto (default): a thinking model's <think> block (a chat template that writes both tags: "
                        "Qwen3, QwQ, DeepSeek-R1's distillations) comes back apart from the answer, as OpenAI chat's "
                        "reasoning_content and Anthropic thinking blocks (where the request enables thinking); none: "
                        "the model's text as it is")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names requests may give, as vLLM's option: the first is the one responses "
                        "report and /v1/models lists first; '*' accepts any name, as llama.cpp's server does (for "
                        "agent stacks that send their own model names); default: the bundle's name only")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(handler=cmd_serve)


def cmd_serve(a) -> int:
    import asyncio
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, plus: on SIGTERM or Ctrl-C every in-flight generation ends at once with an error its
        client sees ("the server is shutting down": an error event mid-stream, a 503 otherwise) and its
        KV freed, so connections close cleanly within the grace period instead of being cut when it ends."""

        def handle_exit(self, sig, frame) -> None:
            try:         # a signal handler: hand the work to the event loop rather than take locks here
                asyncio.get_running_loop().call_soon_threadsafe(svc.end_all, signal.Signals(sig).name)
            except RuntimeError:
                pass
            super().handle_exit(sig, frame)

    from imp_runtime.server import Limits, build_app

    # Two threads share the GIL: the generation thread (a step every few ms) and the event loop (a server-sent
    # event per token per client). Python's default 5 ms switch interval lets the loop keep the GIL for a whole
    # step's worth of time while the GPU idles; 0.5 ms hands it back about as soon as the step is ready.
    sys.setswitchinterval(float(os.environ.get("IMP_SWITCH_INTERVAL", "0.0005")))

    if a.max_step_tokens is not None and a.max_step_tokens < 1:
        print(f"imp serve: --max-step-tokens {a.max_step_tokens}: give a positive number", file=sys.stderr)
        return 2
    names = tuple(a.served_model_name or ())
    if any(not n.strip() for n in names):
        print("imp serve: --served-model-name: give non-empty names", file=sys.stderr)
        return 2
    limits = Limits(max_n=a.max_n, max_running=a.max_running, max_body_bytes=int(a.max_body_mb * 2**20),
                    step_tokens=a.max_step_tokens, model_names=names,
                    allowed_origins=tuple(a.allowed_origins or ()), reasoning=a.reasoning_parser == "auto")
    app, svc = build_app(a.bundle, device=a.device, api_key=a.api_key, limits=limits)
    also = [f"'{n}'" for n in svc.served.names[1:]] + (["any model name"] if svc.served.any else [])
    print(f"imp serving {svc.model}{' (also ' + ', '.join(also) + ')' if also else ''} "
          f"({svc.engine.executor.name} executor, tool calls as {svc.tool_format.name}) "
          f"on http://{a.host}:{a.port}/{'  [API key required]' if a.api_key else ''}", file=sys.stderr)
    auth = ' -H "Authorization: Bearer $IMP_API_KEY"' if a.api_key else ""
    print(f"chat page: http://{a.host}:{a.port}/\ntry:  curl -N http://{a.host}:{a.port}/v1/chat/completions{auth} "
          f"-H 'Content-Type: application/json' -d '{{\"model\": \"{svc.model}\", \"stream\": true, "
          f"\"messages\": [{{\"role\": \"user\", \"content\": \"Why is the sky blue?\"}}]}}'", file=sys.stderr)
    Server(uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=3)).run()
    return 0
