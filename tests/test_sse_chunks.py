"""The streamed chunks' template path (runtime/server/openai_api.TextChunks) against rendering each chunk whole
with json.dumps (the oracle): the same bytes for any text."""
from __future__ import annotations

import json

import numpy as np

from imp_runtime.server.openai_api import TextChunks, chunker

TEXTS = ["", " hello", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x01\x1f control", "😀 中文 ünï",
         "\u2028\u2029 separators", "</script>", "{\"json\": [1, 2]}", TextChunks.SLOT[:-1]]


def test_text_chunks_are_the_whole_render():
    rng = np.random.default_rng(0)
    texts = TEXTS + ["".join(chr(int(c)) for c in rng.integers(1, 0x3000, 12)) for _ in range(50)]
    for kind, usage in (("text_completion", False), ("chat.completion.chunk", True)):
        chunk = chunker("cmpl-x\"y", kind, 1700000000, "model/\u00e9", usage)
        shapes = (lambda i, t: {"index": i, "text": t, "logprobs": None, "finish_reason": None},
                  lambda i, t: {"index": i, "delta": {"content": t}, "logprobs": None, "finish_reason": None})
        for make in shapes:
            fast = TextChunks(chunk, make)
            for i in (0, 3):
                for t in texts:
                    got = fast(i, t)
                    assert got == chunk(make(i, t))
                    assert json.loads(got[len("data: "):])["choices"][0]["index"] == i
