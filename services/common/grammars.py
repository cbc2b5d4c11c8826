"""A request's `Grammar` (contracts) as xgrammar's grammar, and why one does not compile.

Both halves use it: the tokenizer parses a request's grammar before admitting it, so a bad JSON
schema, regex or EBNF is a 400 naming the field (`tokenizer/structured.py`); the scheduler compiles
it against the model's tokenizer (`scheduler/grammar.py`), which refuses what a tokenizer without
xgrammar (the torch-free front-end image) let through. Parsing is where xgrammar refuses a grammar;
compiling it into token masks adds nothing a request can get wrong.

xgrammar (and torch under it) is imported on the first grammar: seconds and hundreds of MB that a
process never asked for structured output does not pay.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys

from contracts.scheduler import Grammar, GrammarKind

# xgrammar's C++ errors start with where they were raised: "[13:52:26] /project/cpp/regex_converter.cc:94: "
_SOURCE_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s*\S+:\d+:\s*")


def xgrammar_installed() -> bool:
    return "xgrammar" in sys.modules or importlib.util.find_spec("xgrammar") is not None


def compile_failure(exc: Exception) -> str:
    """xgrammar's reason, as a client reads it: "does not compile: <reason>"."""
    return "does not compile: " + _SOURCE_PREFIX.sub("", str(exc)).strip()


def parse_failure(grammar: Grammar) -> str | None:
    """Why xgrammar refuses `grammar` (`compile_failure`'s words); None when it parses, or when
    xgrammar is not installed here (the scheduler's compile then decides)."""
    if not xgrammar_installed():
        return None
    try:
        xgrammar_of(grammar)
    except Exception as exc:  # xgrammar raises RuntimeError (and ValueError subclasses) for bad grammars
        return compile_failure(exc)
    return None


def xgrammar_of(grammar: Grammar):
    """The xgrammar `Grammar` of `grammar`: its kind's, between its literal prefix and suffix.
    JSON comes without free whitespace, so a weak model cannot pad its answer forever."""
    import xgrammar

    if grammar.kind == GrammarKind.JSON_OBJECT:
        body = xgrammar.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False, strict_mode=False)
    elif grammar.kind == GrammarKind.JSON_SCHEMA:
        body = xgrammar.Grammar.from_json_schema(grammar.text, any_whitespace=False)
    elif grammar.kind == GrammarKind.REGEX:
        body = xgrammar.Grammar.from_regex(grammar.text)
    else:
        body = xgrammar.Grammar.from_ebnf(grammar.text)
    parts = [_literal(grammar.prefix), body, _literal(grammar.suffix)]
    parts = [part for part in parts if part is not None]
    return body if len(parts) == 1 else xgrammar.Grammar.concat(*parts)


def _literal(text: str):
    if not text:
        return None
    import xgrammar

    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return xgrammar.Grammar.from_ebnf(f'root ::= "{escaped}"')
