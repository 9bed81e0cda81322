"""Whether a grammar compiles, asked of the engine's own compiler (llguidance with the tiny preset's
vocabulary): the one rule about a grammar or a schema that the OpenAPI documents cannot state, so the
fuzz tests know which schema-valid bodies are a correct 400 rather than a rejected valid request."""
from __future__ import annotations

from model.config import preset
from model.grammar import GrammarError, default_tokenizer_json, grammar_source, token_grammar


def grammar_compiles(spec: object) -> bool:
    cfg = preset("tiny")
    try:
        token_grammar(default_tokenizer_json(None), cfg.vocab_size, cfg.eos_token_id).check(grammar_source(spec))
    except GrammarError:
        return False
    return True


def schema_compiles(schema: object) -> bool:
    return grammar_compiles({"type": "json_schema", "schema": schema})
