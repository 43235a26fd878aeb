"""The constraints and engine that tests/test_structured_output.py and test_structured_overlap.py
share: 33 JSON schemas built from a table of property kinds, a regex, choices, and the embedded
model's LLM warm for them."""
import numpy as np

from tests.server_harness import built_once, store_of

NAME = {"type": "string", "maxLength": 16}
AGE = {"type": "integer", "minimum": 0, "maximum": 150}
SCORE = {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.01}   # digits bounded: see the README
COLOR = {"enum": ["red", "green", "blue"]}
FLAG = {"type": "boolean"}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}
COORD = {"type": "integer", "minimum": -999, "maximum": 999}
POINT = {"type": "object", "properties": {"x": COORD, "y": COORD}, "required": ["x", "y"]}
PROPERTIES = {"name": NAME, "age": AGE, "score": SCORE, "color": COLOR, "ok": FLAG, "tags": TAGS, "point": POINT,
              "note": {"anyOf": [NAME, {"type": "null"}]}, "version": {"const": "v1"},
              "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
              "points": {"type": "array", "items": POINT, "minItems": 1, "maxItems": 2},
              "matrix": {"type": "array", "items": {"type": "array", "items": AGE, "maxItems": 2}, "maxItems": 2}}


def schemas() -> list[dict]:
    """30 object schemas of 1-4 properties from PROPERTIES (some nested a level deeper), a part
    of them required, plus a $ref, a top-level array and a top-level enum."""
    rng = np.random.default_rng(7)
    names = sorted(PROPERTIES)
    out = []
    for i in range(30):
        picked = [str(k) for k in rng.choice(names, size=1 + i % 4, replace=False)]
        props = {k: PROPERTIES[k] for k in picked}
        if i % 5 == 0:   # nested: one more object level
            props["inner"] = {"type": "object", "properties": {k: PROPERTIES[k] for k in picked[:2]},
                              "required": picked[:1]}
        required = [k for j, k in enumerate(props) if j % 2 == 0 or i % 3 == 0]
        out.append({"type": "object", "properties": props, "required": required})
    out.append({"$defs": {"p": POINT}, "type": "object", "properties": {"from": {"$ref": "#/$defs/p"},
                                                                         "to": {"$ref": "#/$defs/p"}},
                "required": ["from", "to"]})
    out.append({"type": "array", "items": COLOR, "minItems": 2, "maxItems": 4})
    out.append({"enum": [1, "two", None, 3.5]})
    return out


REGEX = r"[A-Z][a-z]{1,6} [0-9]{2,4}"
CHOICES = ("yes", "no", "a longer answer")
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=64, prefill_chunk_size=32, max_prefill_seqs=2,
              max_model_len=256, page_size=16, num_pages=272, step_shapes="largest")


def warm_llm():
    """The embedded model's LLM with ENGINE, warm: its executables are built once for this file
    and test_structured_overlap.py (built_once), which may run at the same time."""
    from jaxserve import LLM

    with built_once("embedded", sorted(ENGINE.items())):
        llm = LLM(model=None, **ENGINE, compilation_cache_dir=store_of(ENGINE))
        llm.llm_engine.warmup()
    return llm
