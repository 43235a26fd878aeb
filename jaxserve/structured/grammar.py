"""The grammar library behind structured output: llguidance (why: benchmarks/results/
structured_output.md). The rest of jaxserve sees only `check`, `Grammars` and `Matcher`.

A JSON schema's output is laid out as json.dumps does, with no other whitespace (llguidance
allows any by default, and a small model then pads forever); properties come in the schema's order.
"""
from __future__ import annotations

import functools
import json
import logging
import re
from typing import Callable

import llguidance

from jaxserve.sampling_params import InvalidRequest
from jaxserve.structured.masks import mask_words
from jaxserve.structured.spec import StructuredOutput
from jaxserve.tokenizer import HFTokenizer, Tokenizer

log = logging.getLogger(__name__)
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar(c: StructuredOutput) -> str:
    """llguidance's grammar text for `c` (ValueError on a schema that is not JSON, a GBNF grammar
    that does not parse)."""
    if c.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(c.spec, defaults=JSON_FORMAT)
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "grammar":   # Lark as it is, GBNF converted to Lark
        return llguidance.grammar_from("grammar", c.spec)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.spec))


def check(c: StructuredOutput) -> str | None:
    """Why `c` does not compile (an unknown type, an unsupported keyword, a bad regex), or None."""
    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_grammar(c))
    except ValueError as e:
        return str(e)
    return messages[0].strip() if failed else None


class Matcher:
    """One sequence's place in its grammar; until the output holds `after` (bytes), the grammar
    waits and any token may come."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int, after: bytes = b"",
                 token_bytes: Callable[[int], bytes] | None = None):
        self._m, self.words = matcher, words
        self._after, self._token_bytes = after, token_bytes
        self._tail = b""   # while waiting: the output's last bytes, too few to hold `after`

    def _scan(self, tokens) -> tuple[int | None, bytes]:
        """While waiting: how many of `tokens` (next after the output) come before the grammar
        applies (None: not within them), and the output's tail after them."""
        tail = self._tail
        for i, token in enumerate(tokens):
            tail += self._token_bytes(token)
            if self._after in tail:
                return i + 1, b""
            tail = tail[max(0, len(tail) - len(self._after) + 1):]
        return None, tail

    def fill(self, address: int, ahead: list[int] = ()) -> None:
        """Write the tokens allowed next into the int32[words] row at `address` (bit t % 32 of
        word t // 32 for token t; an address, not an array: numpy's `.ctypes.data` costs a few µs
        a row), after `ahead` (a verify row's earlier proposals: consumed while the grammar
        takes them, then rolled back; positions after a refused one are discarded anyway). While
        the grammar waits the row is left as it is: token_masks gives rows every bit."""
        if self._after:
            start, _ = self._scan(ahead)
            if start is None:
                return
            ahead = ahead[start:]
        taken = self._m.try_consume_tokens(list(ahead)) if ahead else 0
        self._m.unsafe_compute_mask_ptr(address, self.words * 4)
        if taken:
            self._m.rollback(taken)

    def accept(self, token: int) -> bool:
        """Take the sampled token; True when the output is complete (nothing but eos may follow),
        or the matcher failed (which the mask prevents: logged)."""
        if self._after:
            start, self._tail = self._scan([token])
            if start is not None:
                self._after = b""   # the grammar applies from the next token
            return False
        if not self._m.consume_token(token):
            log.error("grammar matcher refused token %d: %s", token, self._m.get_error())
        return self._m.is_stopped()


class Grammars:
    """Matchers for one engine's tokenizer and vocabulary (the logits' width, which may exceed the
    tokenizer's). The tokenizer's token table for llguidance is built on first use."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self.words = mask_words(vocab_size)

    @functools.cached_property
    def _tokens(self) -> llguidance.LLTokenizer:
        if isinstance(self.tokenizer, HFTokenizer):
            source = self.tokenizer.tk.to_str()
        else:
            source = llguidance.TokenizerWrapper(_Pieces(self.tokenizer))
        return llguidance.LLTokenizer(source, n_vocab=self.vocab_size, eos_token=self.eos)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a piece of a character: its bytes, not U+FFFD's; a special
        token: its text), from the table the matchers read."""
        return self._tokens.decode_bytes([token_id])

    def matchers(self, c: StructuredOutput | None, n: int) -> list[Matcher | None]:
        """A matcher per choice of a request constrained by `c` (Nones without one)."""
        if c is None:
            return [None] * n
        m = llguidance.LLMatcher(self._tokens, _grammar(c), log_level=0)
        if m.is_error():
            raise InvalidRequest(f"structured output: {m.get_error()}", param="structured_output")
        return [Matcher(m if i == 0 else m.deep_copy(), self.words, c.after.encode(), self.token_bytes)
                for i in range(n)]


class _Pieces:
    """A sentencepiece tokenizer as llguidance's TokenizerWrapper reads it: each token's bytes."""

    def __init__(self, tokenizer):
        self._encode = tokenizer.encode
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_ids | {tokenizer.sp.unk_id()})   # never generated
        self.tokens = [_piece_bytes(p) for p in tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))]

    def __call__(self, text: str) -> list[int]:
        return self._encode(text, add_special_tokens=False)


def _piece_bytes(piece: str) -> bytes:
    byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
    return bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()
