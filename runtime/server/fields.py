"""Typed reading of request fields. Every missing field, wrong type or out-of-range value becomes a 400
that names the field (`temperature: expected a number, got "hot"`), never a 500."""
from __future__ import annotations

import json
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
    return "an object"


def _wrong(name: str, expected: str, v: Any):
    shown = json.dumps(v)[:40] if not isinstance(v, (dict, list)) else _kind(v)
    return bad_request(name, f"expected {expected}, got {shown}")


def parse_json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request("body", f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise bad_request("body", f"the request body must be a JSON object, got {_kind(body)}")
    return body


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
        raise bad_request(label, f"must be at least {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad_request(label, f"must be at most {hi}, got {v}")
    return v


def get_number(obj: dict, name: str, default=None, *, lo: float | None = None, hi: float | None = None,
               label: str | None = None):
    label = label or name
    v = obj.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _wrong(label, "a number", v)
    if lo is not None and v < lo:
        raise bad_request(label, f"must be at least {lo:g}, got {v:g}")
    if hi is not None and v > hi:
        raise bad_request(label, f"must be at most {hi:g}, got {v:g}")
    return float(v)


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
