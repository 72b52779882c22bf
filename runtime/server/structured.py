"""Structured output by token masking, with llguidance: JSON schemas, regular expressions and lark
grammars (forced tool calls) become an Engine `Constraint` whose mask the sampler applies, so the
output parses by construction. A schema llguidance cannot enforce, or a grammar it accepts but cannot run,
is refused up front (400 naming the field) rather than silently generated unconstrained; a grammar that
fails later, mid-generation, raises ConstraintError, which ends the request with an error."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance as llg
import numpy as np

from imp_runtime.engine import RequestError
from imp_runtime.server.errors import bad_request


# Errors without llguidance's parser-state dump (which is long and would echo the grammar back).
_LIMITS = llg.LLParserLimits(verbose_errors=False)

# What response formats' JSON may hold between tokens: JSON's own whitespace, so a model that writes
# `{\n  "name": ...` (as instructor's JSON modes expect, and as small models do by habit) is not pushed off
# course, but at most one line break and 32 spaces or tabs per gap, so it cannot loop on whitespace.
JSON_WHITESPACE = {"whitespace_flexible": True, "whitespace_pattern": r"(\r?\n)?[\x20\x09]{0,32}"}

# Tokens walked when a grammar is checked: llguidance accepts some grammars it cannot run (`a{99999999}`
# exhausts its lexer on the first token), and those are refused up front rather than mid-generation.
_PROBE_TOKENS = 4


class ConstraintError(RequestError):
    """The grammar cannot continue (llguidance hit a resource limit, or no token is allowed): the request
    must end with an error, never look like a normal stop. A RequestError, so the scheduler reports it as
    the request's problem (a 400), not the server's."""


@dataclass(frozen=True)
class Grammar:
    source: str          # an llguidance grammar, checked
    field: str           # the request field it came from, named in every error about it


class Grammars:
    """The llguidance tokenizer of one engine (built once, ~0.3 s) and grammar compilation."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: set[int]):
        # n_vocab covers the model's logits (which may be padded past the tokenizer's vocabulary)
        self.vocab = vocab_size
        self.unavailable: str | None = None
        try:
            self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)
        except ValueError as e:      # e.g. a word-level tokenizer: serve, but refuse constraints clearly
            self.tok, self.unavailable = None, str(e)

    def json_schema(self, schema, field: str) -> Grammar:
        if not isinstance(schema, dict):
            raise bad_request(field, "a JSON schema must be an object")
        schema = dict(schema)
        schema.setdefault("x-guidance", JSON_WHITESPACE)
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise bad_request(field, f"invalid JSON schema: {e}") from None
        return self.check(grammar, field)

    def regex(self, pattern, field: str) -> Grammar:
        if not isinstance(pattern, str) or not pattern:
            raise bad_request(field, "expected a non-empty regular expression string")
        return self.check(llg.LLMatcher.grammar_from_regex(pattern), field)

    def lark(self, source: str, field: str) -> Grammar:
        return self.check(llg.LLMatcher.grammar_from_lark(source), field)

    def check(self, source: str, field: str) -> Grammar:
        if self.tok is None:
            raise bad_request(field, "structured output and forced tool calls are not available for this model: "
                                     f"grammar constraints cannot read its tokenizer ({self.unavailable})")
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(source, self.tok, limits=_LIMITS)
        if is_error:
            raise bad_request(field, _explain(messages[0] if messages else "invalid grammar"))
        grammar = Grammar(source, field)
        self._probe(grammar)
        return grammar

    def _probe(self, grammar: Grammar) -> None:
        """Walk the first few tokens the grammar allows (the lowest id each step): a grammar that fails
        there fails for every generation, so it is a 400 now."""
        probe = self.constraint(grammar)
        try:
            for _ in range(_PROBE_TOKENS):
                if probe.is_done():
                    return
                probe.advance(int(np.argmax(probe.allowed())))
        except ConstraintError as e:
            raise bad_request(grammar.field, f"the grammar cannot be run: {e}") from None

    def constraint(self, grammar: Grammar) -> "GrammarConstraint":
        matcher = llg.LLMatcher(self.tok, grammar.source, log_level=0, limits=_LIMITS)
        return GrammarConstraint(matcher, self.vocab, grammar.field)


def _explain(message: str) -> str:
    m = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if m:
        keys = ", ".join(json.loads(f"[{m.group(1)}]"))
        return f"unsupported JSON schema keyword {keys} (structured output cannot enforce it)"
    # llguidance's messages run over several lines (the source, a caret); keep the first and the verdict
    lines = [ln.strip() for ln in message.strip().splitlines()]
    verdict = [ln for ln in lines[1:] if ln.startswith("error:")]
    return "the schema or grammar cannot be enforced: " + "; ".join(lines[:1] + verdict)


class GrammarConstraint:
    """The Engine's Constraint protocol over an llguidance matcher. llguidance reports failures by an
    error state, not by raising; each call here turns that state into a ConstraintError, so a failure
    mid-generation ends the request with an error the client sees."""

    def __init__(self, matcher: llg.LLMatcher, vocab: int, field: str):
        self.m = matcher
        self.vocab = vocab
        self.field = field
        self.failure: ConstraintError | None = None     # set once the grammar has failed

    def _fail(self, message: str):
        self.failure = ConstraintError(message)
        raise self.failure

    def _raise_if_failed(self) -> None:
        if self.m.is_error():
            self._fail(_first_line(self.m.get_error()))

    def allowed(self) -> np.ndarray:
        self._raise_if_failed()
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        self._raise_if_failed()
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)
        if not mask.any():
            self._fail("the grammar allows no next token")
        return mask

    def advance(self, token_id: int) -> None:
        if not self.m.consume_token(token_id):
            self._raise_if_failed()
            self._fail(f"the grammar does not allow token {token_id}")
        self._raise_if_failed()

    def is_done(self) -> bool:
        self._raise_if_failed()
        return self.m.is_stopped()


def _first_line(message: str) -> str:
    return (message.strip().splitlines() or ["unknown grammar error"])[0]
