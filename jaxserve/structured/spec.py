"""What a request constrains its output to, independent of the grammar library."""
from __future__ import annotations

import dataclasses
import json

KINDS = ("json", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """`kind` "json": `spec` is a JSON schema as JSON text ('{"type": "object"}' for any object);
    "regex": a pattern the whole output matches; "choice": a tuple of strings, the output is one
    of them; "grammar": a context-free grammar, in Lark (llguidance's dialect: `start: ...`) or in
    GBNF (llama.cpp's and xgrammar's: `root ::= ...`). `after`: the grammar applies once the output holds this text (a thinking model's
    `</think>`: jaxserve/server/reasoning.py), any token before it; "" from the first token."""
    kind: str
    spec: str | tuple[str, ...]
    after: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "StructuredOutput":
        """Objects with declared properties get no others unless the schema says
        `additionalProperties` (as xgrammar's strict mode does): the outputs still validate, and
        a small model cannot add keys forever."""
        return cls("json", json.dumps(closed_objects(schema)))

    def error(self) -> str | None:
        """Why the constraint cannot be used (a message for a 400), or None."""
        if self.kind not in KINDS:
            return f"unknown kind {self.kind!r} (one of {', '.join(KINDS)})"
        if self.kind == "choice" and not (self.spec and isinstance(self.spec, tuple)
                                          and all(isinstance(c, str) for c in self.spec)):
            return "the choices must be a non-empty list of strings"
        if self.kind != "choice" and not isinstance(self.spec, str):
            return "the schema, pattern or grammar must be a string"
        if not isinstance(self.after, str):
            return "after must be a string"
        from jaxserve.structured.grammar import check  # the library loads only when a request needs it

        return check(self)


# Keywords whose value is a schema, a list of schemas, or a mapping of names to schemas.
_SCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
           "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema):
    """`schema` with `"additionalProperties": false` in every schema that lists properties and
    says nothing of others."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if key in out:
            out[key] = [closed_objects(s) for s in out[key]] if isinstance(out[key], list) else closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out
