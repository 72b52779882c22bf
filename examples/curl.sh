#!/bin/sh
# `impc serve` with curl: every endpoint once. Usage: examples/curl.sh [http://127.0.0.1:8080] [KEY]
set -e
URL=${1:-http://127.0.0.1:8080}
KEY=${2:-none}
H="Authorization: Bearer $KEY"

curl -s "$URL/health"; echo
curl -s "$URL/v1/models" -H "$H"; echo

echo "# chat, streamed (one SSE chunk per token)"
curl -sN "$URL/v1/chat/completions" -H "$H" -H 'content-type: application/json' -d '{
  "messages": [{"role": "user", "content": "Say hello in French."}],
  "max_tokens": 16, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}'

echo "# completion"
curl -s "$URL/v1/completions" -H "$H" -H 'content-type: application/json' -d '{
  "prompt": "The three primary colours are", "max_tokens": 12, "temperature": 0}'; echo

echo "# responses"
curl -s "$URL/v1/responses" -H "$H" -H 'content-type: application/json' -d '{
  "input": "Name a fruit.", "max_output_tokens": 12, "temperature": 0}'; echo

echo "# regular expression output"
curl -s "$URL/v1/chat/completions" -H "$H" -H 'content-type: application/json' -d '{
  "messages": [{"role": "user", "content": "Is water wet?"}], "max_tokens": 8, "temperature": 0,
  "response_format": {"type": "regex", "regex": "(Yes|No)\\."}}'; echo

echo "# anthropic messages, streamed"
curl -sN "$URL/v1/messages" -H "x-api-key: $KEY" -H 'anthropic-version: 2023-06-01' -H 'content-type: application/json' -d '{
  "model": "'"$(curl -s "$URL/v1/models" -H "$H" | sed 's/.*"id": *"\([^"]*\)".*/\1/')"'",
  "max_tokens": 16, "temperature": 0, "stream": true,
  "messages": [{"role": "user", "content": "Say hello in Spanish."}]}'

echo "# anthropic count_tokens"
curl -s "$URL/v1/messages/count_tokens" -H "x-api-key: $KEY" -H 'content-type: application/json' -d '{
  "messages": [{"role": "user", "content": "Say hello in Spanish."}]}'; echo

curl -s "$URL/metrics" | grep -E '^imp_(requests_total|generation_tokens_total|time_to_first_token_seconds_count)'
