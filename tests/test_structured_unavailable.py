"""A bundle whose tokenizer llguidance cannot read (a word-level one, as synthetic bundles have) is still
served; structured output and forced tool calls on it are a 400 naming the field, not a crash at start."""
from __future__ import annotations

import pytest


def test_word_level_tokenizer_refuses_grammars_clearly():
    from impc.synthetic import stub_tokenizer_json
    from imp_runtime.server.errors import APIError
    from imp_runtime.server.structured import Grammars
    g = Grammars(stub_tokenizer_json(1000), 1000, {2})          # must not raise
    assert g.unavailable
    for call in (lambda: g.regex("a+", "response_format.regex"),
                 lambda: g.json_schema({"type": "object"}, "response_format.json_schema.schema")):
        with pytest.raises(APIError) as e:
            call()
        assert e.value.status == 400 and "response_format" in str(e.value) and "tokenizer" in str(e.value)
