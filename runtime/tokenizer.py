"""The bundle's tokenizer (a `tokenizers.Tokenizer`) and incremental detokenization for streaming."""
from __future__ import annotations

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream


class Tokenizer:
    def __init__(self, tokenizer_json: str, tok_info: dict):
        self.tok = _HFTokenizer.from_str(tokenizer_json)
        self.bos_token = tok_info.get("bos_token")
        self.eos_token = tok_info.get("eos_token")
        self.add_bos = bool(tok_info.get("add_bos"))
        self.eos_ids = set(tok_info.get("eos_token_ids") or [])
        if self.eos_token and (eid := self.tok.token_to_id(self.eos_token)) is not None:
            self.eos_ids.add(eid)
        self.bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Rendered chat text already holds its special tokens, so none are added by default."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def detokenizer(self) -> "Detokenizer":
        return Detokenizer(self)


class Detokenizer:
    """Turns a growing list of ids into text deltas: the tokenizers library's DecodeStream, which decodes a
    window of recent tokens (so multi-token characters and leading-space rules come out right) and holds a
    delta ending in an incomplete UTF-8 character back until the next token completes it. One native call a
    token (decoding the window twice from Python cost ~3x as much, per token of every stream)."""

    def __init__(self, tokenizer: Tokenizer):
        self.t = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        return self.stream.step(self.t.tok, token_id) or ""
