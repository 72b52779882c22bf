"""Typed reading of request fields. Every missing field, wrong type or out-of-range value becomes a 400
that names the field (`temperature: expected a number, got "hot"`), never a 500."""
from __future__ import annotations

import json
import math
from typing import Any

from imp_runtime.server.errors import bad_request

_MISSING = object()


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, _NotFinite):
        return v.text[:20]
    return "an object"


def _wrong(name: str, expected: str, v: Any):
    shown = json.dumps(v)[:40] if not isinstance(v, (dict, list)) else _kind(v)
    return bad_request(name, f"expected {expected}, got {shown}")


class _NotFinite:
    """Where the body held NaN, Infinity or a number too large for a float: Python's JSON reader takes
    them, JSON has no such numbers, and a sampler given one samples garbage. Kept as a marker so the
    400 can name the field."""

    def __init__(self, text: str):
        self.text = text


def _float_or_marker(text: str):
    v = float(text)
    return v if math.isfinite(v) else _NotFinite(text)


def parse_json_object(raw: bytes, max_depth: int = 64) -> dict:
    """The request body: a JSON object of finite numbers and valid Unicode strings, nested at most
    `max_depth` deep. Anything else is a 400 naming the field, before any work starts."""
    try:
        body = json.loads(raw, parse_constant=_NotFinite, parse_float=_float_or_marker)
    except RecursionError:
        raise bad_request("body", f"the request body is nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request("body", f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise bad_request("body", f"the request body must be a JSON object, got {_kind(body)}")
    _check_tree(body, max_depth)
    return body


def _valid_unicode(s: str) -> bool:
    # a JSON escape can spell a lone UTF-16 surrogate ("\ud800"), which no encoder (or tokenizer) takes
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


_PLAIN = frozenset((int, float, bool, type(None)))     # values with nothing to check (not _NotFinite: its own type)


def _check_tree(body: dict, max_depth: int) -> None:
    """Depth and string checks without recursion (the body is untrusted); paths are built only for the
    error message."""
    stack: list[tuple[object, tuple, int]] = [(body, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > max_depth:
            raise bad_request(_path(path[:1]) or "body", f"nested deeper than {max_depth} levels")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if type(v) in _PLAIN and type(k) is not str:      # a list's number (a prompt's 2,000 token ids)
                continue
            if isinstance(k, str) and not _valid_unicode(k):
                raise bad_request(_path(path) or "body", f"the key {ascii(k)[:40]} is not valid Unicode "
                                                        "(a lone UTF-16 surrogate)")
            if isinstance(v, str):
                if not _valid_unicode(v):
                    raise bad_request(_path(path + (k,)), "not valid Unicode (a lone UTF-16 surrogate)")
            elif isinstance(v, _NotFinite):
                raise bad_request(_path(path + (k,)), f"expected a finite number, got {v.text[:20]}")
            elif isinstance(v, (dict, list)):
                stack.append((v, path + (k,), depth + 1))


def _path(path: tuple) -> str:
    """("messages", 0, "content") -> messages[0].content"""
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def get_int(obj: dict, name: str, default=None, *, lo: int | None = None, hi: int | None = None,
            required: bool = False, label: str | None = None):
    label = label or name
    v = obj.get(name, _MISSING)
    if v is _MISSING or v is None:
        if required:
            raise bad_request(label, "this field is required")
        return default
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
        raise _wrong(label, "an integer", v)
    v = int(v)
    if lo is not None and v < lo:
        raise bad_request(label, f"must be at least {lo}, got {_short(v)}")
    if hi is not None and v > hi:
        raise bad_request(label, f"must be at most {hi}, got {_short(v)}")
    return v


def _short(v: int) -> str:
    text = str(v)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def get_number(obj: dict, name: str, default=None, *, lo: float | None = None, hi: float | None = None,
               label: str | None = None):
    label = label or name
    v = obj.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _wrong(label, "a number", v)
    try:
        v = float(v)                    # an integer of 400 digits is no float
    except OverflowError:
        raise bad_request(label, f"expected a finite number, got {_short(v)}") from None
    if not math.isfinite(v):
        raise bad_request(label, f"expected a finite number, got {v}")
    if lo is not None and v < lo:
        raise bad_request(label, f"must be at least {lo:g}, got {v:g}")
    if hi is not None and v > hi:
        raise bad_request(label, f"must be at most {hi:g}, got {v:g}")
    return v


def get_bool(obj: dict, name: str, default: bool = False, label: str | None = None) -> bool:
    v = obj.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _wrong(label or name, "a boolean", v)
    return v


def _get_typed(obj: dict, name: str, kind: type, what: str, default, required: bool, label: str | None):
    label = label or name
    v = obj.get(name)
    if v is None:
        if required:
            raise bad_request(label, "this field is required")
        return default
    if not isinstance(v, kind):
        raise _wrong(label, what, v)
    return v


def get_str(obj: dict, name: str, default=None, *, required: bool = False, label: str | None = None):
    return _get_typed(obj, name, str, "a string", default, required, label)


def get_list(obj: dict, name: str, default=None, *, required: bool = False, label: str | None = None):
    return _get_typed(obj, name, list, "an array", default, required, label)


def get_obj(obj: dict, name: str, default=None, *, required: bool = False, label: str | None = None):
    return _get_typed(obj, name, dict, "an object", default, required, label)


def get_logit_bias(obj: dict, name: str, vocab: int) -> dict[int, float]:
    """OpenAI's `logit_bias`: an object of token ids (as strings: JSON keys) to numbers in [-100, 100], added to
    those tokens' logits before sampling; -100 bans a token in effect, 100 all but forces it."""
    v = get_obj(obj, name, {})
    out: dict[int, float] = {}
    for key, bias in v.items():
        where = f"{name}[{json.dumps(key)}]"
        if not (key.isascii() and key.strip().lstrip("-").isdigit()):
            raise bad_request(where, f"expected a token id as the key, got {json.dumps(key)[:40]}")
        tid = int(key)
        if not 0 <= tid < vocab:
            raise bad_request(where, f"token ids must be in [0, {vocab})")
        if bias is None:
            raise bad_request(where, "expected a number in [-100, 100], got null")
        out[tid] = get_number(v, key, lo=-100.0, hi=100.0, label=where)
    return out


def get_token_ids(obj: dict, name: str, vocab: int, most: int | None = 64, *, required: bool = False) -> list[int]:
    """An array of token ids in [0, vocab) (vLLM's `stop_token_ids`, at most `most`; /detokenize's `tokens`)."""
    v = get_list(obj, name, [], required=required)
    if (most is not None and len(v) > most) or not all(type(x) is int for x in v):   # (type: a bool is not an id)
        raise bad_request(name, "expected an array of " + (f"at most {most} " if most is not None else "") + "token ids")
    if v and (min(v) < 0 or max(v) >= vocab):
        raise bad_request(name, f"token ids must be in [0, {vocab})")
    return v


def get_stop(obj: dict, name: str, most: int = 16, allow_string: bool = True) -> list[str]:
    """OpenAI's `stop` (a string or an array of strings; OpenAI allows 4, we allow `most`), or
    Anthropic's `stop_sequences` (an array only)."""
    v = obj.get(name)
    if v is None:
        return []
    if isinstance(v, str) and allow_string:
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _wrong(name, "a string or an array of strings" if allow_string else "an array of strings", v)
    if len(v) > most:
        raise bad_request(name, f"at most {most} stop sequences, got {len(v)}")
    return [s for s in v if s]
