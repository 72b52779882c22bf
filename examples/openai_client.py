"""Talk to `impc serve` with the official openai SDK: a streamed chat, a forced tool call, JSON output.

    impc serve build/smollm2 --port 8080 &
    python examples/openai_client.py [--base-url http://127.0.0.1:8080/v1] [--api-key KEY]
"""
from __future__ import annotations

import argparse
import json

import openai


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key)
    model = client.models.list().data[0].id

    print("# streamed chat")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Why is the sky blue? One sentence."}],
        max_tokens=64, temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")

    print("\n# forced tool call")
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What's the weather in Lisbon?"}], tools=[weather],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=48, temperature=0)
    for call in r.choices[0].message.tool_calls or []:
        print(call.function.name, json.loads(call.function.arguments))

    print("\n# JSON schema output")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    print(json.loads(r.choices[0].message.content))


if __name__ == "__main__":
    main()
