"""Structured output by token masking, with llguidance: JSON schemas, regular expressions and lark
grammars (forced tool calls) become an Engine `Constraint` whose mask the sampler applies, so the
output parses by construction. A schema llguidance cannot enforce is refused up front (400 naming the
keyword) rather than silently generated unconstrained."""
from __future__ import annotations

import json
import re

import llguidance as llg
import numpy as np

from imp_runtime.server.errors import bad_request
from imp_runtime.server.tools import JSON_STYLE


class Grammars:
    """The llguidance tokenizer of one engine (built once, ~0.3 s) and grammar compilation."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: set[int]):
        # n_vocab covers the model's logits (which may be padded past the tokenizer's vocabulary)
        self.vocab = vocab_size
        self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)

    def json_schema(self, schema, field: str) -> str:
        if not isinstance(schema, dict):
            raise bad_request(field, "a JSON schema must be an object")
        schema = dict(schema)
        schema.setdefault("x-guidance", JSON_STYLE)
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise bad_request(field, f"invalid JSON schema: {e}") from None
        return self.check(grammar, field)

    def regex(self, pattern, field: str) -> str:
        if not isinstance(pattern, str) or not pattern:
            raise bad_request(field, "expected a non-empty regular expression string")
        return self.check(llg.LLMatcher.grammar_from_regex(pattern), field)

    def lark(self, source: str, field: str) -> str:
        return self.check(llg.LLMatcher.grammar_from_lark(source), field)

    def check(self, grammar: str, field: str) -> str:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tok)
        if is_error:
            raise bad_request(field, _explain(messages[0] if messages else "invalid grammar"))
        return grammar

    def constraint(self, grammar: str) -> "GrammarConstraint":
        return GrammarConstraint(llg.LLMatcher(self.tok, grammar, log_level=0), self.vocab)


def _explain(message: str) -> str:
    m = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if m:
        keys = ", ".join(json.loads(f"[{m.group(1)}]"))
        return f"unsupported JSON schema keyword {keys} (structured output cannot enforce it)"
    return f"the schema or grammar cannot be enforced: {message.strip()}"


class GrammarConstraint:
    """The Engine's Constraint protocol over an llguidance matcher."""

    def __init__(self, matcher: llg.LLMatcher, vocab: int):
        self.m = matcher
        self.vocab = vocab

    def allowed(self) -> np.ndarray | None:
        if self.m.is_error():       # cannot happen when only allowed tokens are sampled; be safe anyway
            return None
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)

    def advance(self, token_id: int) -> None:
        self.m.consume_token(token_id)

    def is_done(self) -> bool:
        return self.m.is_stopped()
