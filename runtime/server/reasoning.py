"""A thinking model's reasoning told apart from its answer: the text between <think> and </think> (Qwen3, QwQ,
DeepSeek-R1's distillations) becomes `reasoning_content` (OpenAI chat, as vLLM's reasoning parsers and DeepSeek's API
return it) or a thinking block (Anthropic, where the request enabled thinking), not part of the content a client
shows or parses for tool calls. On for chat templates that mention both tags (`impc serve --reasoning-parser none`
turns it off); a template whose generation prompt already opened <think> (DeepSeek-R1's, Qwen3's thinking-only
releases) starts the answer inside the reasoning."""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ReasoningPart:
    text: str


def template_thinks(source: str | None) -> bool:
    """Whether a chat template is a thinking model's (it writes or strips both tags)."""
    return bool(source) and OPEN in source and CLOSE in source


def opens_inside(prompt_tail: str) -> bool:
    """Whether a prompt ending in prompt_tail leaves a <think> open (the answer starts in the reasoning)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest tail of text that is a proper prefix of tag (held back until it is known)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkSplitter:
    """Streamed text -> (is_reasoning, text) segments, in order. The tags themselves are dropped, and so is the
    whitespace right after a tag (the templates write "<think>\\n" and "</think>\\n\\n"); a tag split over several
    pieces is held back until it is whole. Only the first reasoning block counts: text after its </think> is answer,
    whatever it contains."""

    def __init__(self, inside: bool = False):
        self.inside = inside
        self.done = False          # a reasoning block has closed: the rest is the answer
        self.held = ""
        self.strip = inside        # drop whitespace at the start of the next segment

    def feed(self, text: str) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        buf = self.held + text
        self.held = ""
        while buf:
            if self.strip:
                buf = buf.lstrip()
                if not buf:
                    break
                self.strip = False
            if self.done:
                out.append((False, buf))
                break
            tag = CLOSE if self.inside else OPEN
            at = buf.find(tag)
            if at < 0:
                keep = _partial_tag(buf, tag)
                if not self.inside:
                    if buf[:len(buf) - keep].strip():
                        self.done = True            # an answer that did not start with <think>: no reasoning
                        out.append((False, buf))
                    else:
                        self.held = buf             # whitespace, maybe a tag's start: not decided yet
                    break
                if len(buf) > keep:
                    out.append((True, buf[:len(buf) - keep]))
                self.held = buf[len(buf) - keep:]
                break
            if at and (self.inside or buf[:at].strip()):
                if not self.inside:                 # text before a <think>: an answer after all
                    self.done = True
                    out.append((False, buf))
                    break
                out.append((True, buf[:at]))
            buf = buf[at + len(tag):]
            self.done = self.inside                 # </think>: the rest is the answer
            self.inside = not self.inside
            self.strip = True
        return [(r, t) for r, t in out if t]

    def finish(self) -> list[tuple[bool, str]]:
        """What is still held at the end (a tag's prefix that never completed is text)."""
        held, self.held = self.held, ""
        return [(self.inside and not self.done, held)] if held else []
