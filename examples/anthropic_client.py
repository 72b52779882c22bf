"""Talk to `impc serve` with the official anthropic SDK: a streamed message and a forced tool use.

    impc serve build/smollm2 --port 8080 &
    python examples/anthropic_client.py [--base-url http://127.0.0.1:8080] [--api-key KEY]
"""
from __future__ import annotations

import argparse

import anthropic

GREEDY = {"temperature": 0}      # recent SDKs dropped the temperature argument; the server still reads it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    a = ap.parse_args()
    client = anthropic.Anthropic(base_url=a.base_url, api_key=a.api_key)
    import httpx
    model = httpx.get(a.base_url + "/v1/models", headers={"x-api-key": a.api_key}).json()["data"][0]["id"]

    print("# streamed message")
    with client.messages.stream(model=model, max_tokens=64, system="Answer in one sentence.", extra_body=GREEDY,
                                messages=[{"role": "user", "content": "What is a compiler?"}]) as stream:
        for text in stream.text_stream:
            print(text, end="", flush=True)
        final = stream.get_final_message()
    print(f"\n[stop_reason {final.stop_reason}; {final.usage.input_tokens} in, {final.usage.output_tokens} out]")

    print("\n# forced tool use")
    tool = {"name": "get_weather", "description": "Current weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    r = client.messages.create(model=model, max_tokens=48, tools=[tool], extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": "Weather in Nairobi?"}])
    for block in r.content:
        if block.type == "tool_use":
            print(block.name, block.input)
    print("input tokens:", client.messages.count_tokens(model=model, messages=[
        {"role": "user", "content": "Weather in Nairobi?"}]).input_tokens)


if __name__ == "__main__":
    main()
