"""runtime/server/reasoning.py ThinkSplitter: a thinking model's text split into reasoning and answer, checked on
hand-written streams cut at every possible place (the joined segments must not depend on the cuts)."""
from __future__ import annotations

import pytest

from imp_runtime.server.reasoning import ThinkSplitter, opens_inside, template_thinks


def split(pieces: list[str], inside: bool = False) -> tuple[str, str]:
    s = ThinkSplitter(inside)
    segs = [seg for p in pieces for seg in s.feed(p)] + s.finish()
    return "".join(t for r, t in segs if r), "".join(t for r, t in segs if not r)


CASES = [
    # (generated text, starts inside, reasoning, answer)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.\n", "Paris."),
    ("<think>\n\n</think>\n\nParis.", False, "", "Paris."),                 # Qwen3 with enable_thinking false
    ("\n<think>a</think>b", False, "a", "b"),
    ("Paris, no thinking.", False, "", "Paris, no thinking."),
    ("Paris <think>not reasoning</think>", False, "", "Paris <think>not reasoning</think>"),
    ("Let me see.\n</think>\n\nParis.", True, "Let me see.\n", "Paris."),    # the prompt opened <think>
    ("<think>cut short by max_tok", False, "cut short by max_tok", ""),
    ("<think>a</think>b</think>c<think>d", False, "a", "b</think>c<think>d"),
    ("<thin", False, "", "<thin"),
    ("", False, "", ""),
]


@pytest.mark.parametrize("text,inside,reasoning,answer", CASES)
def test_split_whole_and_cut_anywhere(text, inside, reasoning, answer):
    assert split([text], inside) == (reasoning, answer)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert split([text[:i], text[i:j], text[j:]], inside) == (reasoning, answer), (i, j)
    assert split(list(text), inside) == (reasoning, answer)


def test_detection():
    assert template_thinks("{{ '<think>\\n' }}{% if x %}</think>{% endif %}")
    assert not template_thinks("{{ m['content'] }}") and not template_thinks(None)
    assert opens_inside("<|im_start|>assistant\n<think>\n")
    assert not opens_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_inside("<|im_start|>assistant\n")
