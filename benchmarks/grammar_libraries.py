"""Grammar libraries for structured output, measured on our tokenizers: llguidance, outlines-core
and xgrammar (the candidates, not dependencies: pip install llguidance outlines-core xgrammar).

Per library and tokenizer: the tokenizer's one-off setup, each schema's grammar compile time, and
the token-mask time along a valid output of the schema (its compact JSON, tokenized as a
continuation: each token's mask computed, then the token consumed, which must succeed). The
masks themselves are not compared: where the next bytes are forced, llguidance allows only their
canonical tokens, so a mask may refuse a token of this path that the matcher would consume.

Tokenizers: the embedded tiny model's (sentencepiece BPE, 4,096 pieces, byte fallback) and a
32,000-piece Llama-style BPE (metaspace, byte fallback) trained here on the Python standard
library's sources (`--tokenizer-dir`; nothing is downloaded).

    python -m benchmarks.grammar_libraries [--tokenizer-dir /tmp/tok32k]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sysconfig
import time

import numpy as np

from jaxserve.engine import TINY_MODEL_DIR

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]},
             {"name": "Ada Lovelace", "age": 36}),
    "nested": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "status": {"enum": ["open", "closed", "pending"]},
        "owner": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                                   "score": {"type": "number"}},
                  "required": ["name", "email", "score"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}},
        "required": ["id", "status", "owner", "tags", "items"]},
        {"id": 4021, "status": "pending", "owner": {"name": "Grace Hopper", "email": "grace@navy.mil", "score": 97.5},
         "tags": ["compiler", "cobol"], "items": [{"sku": "A-100", "qty": 3}, {"sku": "B-7", "qty": 12}]}),
    "tools": ({"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": name}, "parameters": params},
         "required": ["name", "parameters"]} for name, params in [
            ("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                             "required": ["city", "unit"]}),
            ("search", {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                        "required": ["query"]}),
            ("send_email", {"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
                            "required": ["to", "body"]})]]}},
        [{"name": "search", "parameters": {"query": "structured output", "limit": 5}}]),
}


def llama_style_tokenizer(out_dir: str, vocab_size: int = 32000) -> str:
    """A Llama-2-style BPE tokenizer.json (metaspace, byte fallback, <unk> <s> </s>) trained on the
    standard library's Python sources; returns its path (built once)."""
    path = os.path.join(out_dir, "tokenizer.json")
    if os.path.exists(path):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, size = [], 0
    for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**/*.py"), recursive=True)):
        if size > 8e6:
            break
        with open(f, encoding="utf-8", errors="ignore") as fh:
            texts.append(fh.read())
        size += len(texts[-1])
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        limit_alphabet=200, max_token_length=16))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(path)
    return path


def continuation_ids(tok, text: str) -> list[int]:
    """`text`'s tokens as the model would write them after a prompt (no leading metaspace)."""
    prefix = tok.encode("x", add_special_tokens=False).ids
    ids = tok.encode("x" + text, add_special_tokens=False).ids
    assert ids[:len(prefix)] == prefix, "the prefix merged with the text"
    return ids[len(prefix):]


def token_bytes(piece: str) -> bytes:
    m = re.fullmatch(r"<0x([0-9A-F]{2})>", piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace("▁", " ").encode()


class Llguidance:
    def __init__(self, path, vocab, eos):
        import llguidance
        import llguidance.numpy

        self.llg, self.fill = llguidance, llguidance.numpy.fill_next_token_bitmask
        with open(path) as f:
            self.tok = llguidance.LLTokenizer(f.read(), n_vocab=vocab, eos_token=eos)
        self.mask = llguidance.numpy.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        m = self.llg.LLMatcher(self.tok, self.llg.LLMatcher.grammar_from_json_schema(schema))
        assert not m.is_error(), m.get_error()
        return m

    def mask_then_consume(self, m, token):
        self.fill(m, self.mask, 0)
        assert m.consume_token(token), m.get_error()


class OutlinesCore:
    def __init__(self, path, vocab, eos):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        from tokenizers import Tokenizer

        self.oc, self.regex = outlines_core, build_regex_from_schema
        hf = Tokenizer.from_file(path)
        special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        pieces: dict[bytes, list[int]] = {}
        for i in range(hf.get_vocab_size()):
            if i not in special and i != eos:
                pieces.setdefault(token_bytes(hf.id_to_token(i)), []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, pieces)
        self.mask = np.zeros((vocab + 31) // 32, np.int32)

    def compile(self, schema):
        return self.oc.Guide(self.oc.Index(self.regex(json.dumps(schema)), self.vocab))

    def mask_then_consume(self, g, token):
        g.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)
        g.advance(token, return_tokens=False)   # raises on a token the grammar refuses


class Xgrammar:
    def __init__(self, path, vocab, eos):
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path, eos_token="</s>")
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                                        separators=(",", ":")))

    def mask_then_consume(self, m, token):
        m.fill_next_token_bitmask(self.mask)
        assert m.accept_token(token)


LIBRARIES = {"llguidance": Llguidance, "outlines-core": OutlinesCore, "xgrammar": Xgrammar}


def measure(library, path: str, vocab: int, eos: int, rounds: int = 5) -> dict:
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    lib = LIBRARIES[library](path, vocab, eos)
    row = {"tokenizer_setup_ms": (time.perf_counter() - t0) * 1e3}
    hf = Tokenizer.from_file(path)
    for name, (schema, instance) in SCHEMAS.items():
        ids = continuation_ids(hf, json.dumps(instance, separators=(",", ":")))
        compiles, first, rest = [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            state = lib.compile(schema)
            compiles.append(time.perf_counter() - t0)
            for k, token in enumerate(ids):
                t0 = time.perf_counter()
                lib.mask_then_consume(state, token)
                (first if k == 0 else rest).append(time.perf_counter() - t0)
        row[name] = {"tokens": len(ids), "compile_ms": statistics.median(compiles) * 1e3,
                     "first_mask_ms": statistics.median(first) * 1e3,
                     "mask_us_mean": statistics.mean(rest) * 1e6, "mask_us_p50": statistics.median(rest) * 1e6,
                     "mask_us_max": max(rest) * 1e6}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer-dir", default="/tmp/tok32k", help="where the 32k tokenizer is built")
    p.add_argument("--libraries", nargs="+", default=list(LIBRARIES))
    args = p.parse_args()
    tokenizers = {"tiny (4,096)": (os.path.join(TINY_MODEL_DIR, "tokenizer.json"), 4096),
                  "llama-style (32,000)": (llama_style_tokenizer(args.tokenizer_dir), 32000)}
    for tok_name, (path, vocab) in tokenizers.items():
        for library in args.libraries:
            try:
                row = measure(library, path, vocab, eos=2)
            except ImportError as e:
                print(f"{library}: not installed ({e})")
                continue
            print(json.dumps({"library": library, "tokenizer": tok_name, **row}))


if __name__ == "__main__":
    main()
