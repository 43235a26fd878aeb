"""Tokenizers: a Hugging Face fast tokenizer (tokenizer.json) or a raw sentencepiece model
(tokenizer.model) behind one interface, chat templates, and incremental detokenization.

Decoding never applies `clean_up_tokenization_spaces`: that rewrite (" ." -> ".") depends on the
following text, so streamed deltas would not add up to the full decode.
"""
from __future__ import annotations

import functools
import json
import os
import re
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# An engine step decodes a window of a few ids per row (IncrementalDetokenizer.step_all), ~1 us
# of work each; `tokenizers` would hand them to its thread pool, whose wake-ups cost more than the
# work (128 rows: 0.7 against 0.25 ms a step; benchmarks/results/host_time.md). A user's own
# setting stands.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def load_tokenizer(model_dir: str) -> "Tokenizer":
    """tokenizer.json through `tokenizers` if present, else tokenizer.model through sentencepiece."""
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        return HFTokenizer(model_dir)
    if os.path.exists(os.path.join(model_dir, "tokenizer.model")):
        return SentencePieceTokenizer(model_dir)
    raise FileNotFoundError(f"no tokenizer in {model_dir}: looked for {' and '.join(TOKENIZER_FILES)}")


class Tokenizer:
    """What the engine and server use. Backends fill in the token-level methods."""
    bos_token_id: int | None
    eos_token_ids: list[int]  # the tokenizer's eos first, then generation_config.json's others
    vocab_size: int           # including added tokens

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        # The text of each single id met as a detokenizer's context, by skip_special_tokens (at most
        # the vocabulary's size): see IncrementalDetokenizer._windows.
        self.id_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}
        self.chat_template = _read_chat_template(model_dir, self.config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def encode_pair(self, text_1: str, text_2: str, add_special_tokens: bool = True) -> list[int]:
        """Two texts as one prompt (a cross-encoder's), as `tokenizer(text_1, text_2)` does: here each
        encoded with its special tokens, one after the other, as transformers' sentencepiece Llama
        tokenizer builds a pair."""
        return self.encode(text_1, add_special_tokens) + self.encode(text_2, add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def decode_batch(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        raise NotImplementedError

    @property
    def special_tokens(self) -> dict[str, str | None]:
        """Template variables: bos_token, eos_token, unk_token, pad_token (strings)."""
        raise NotImplementedError

    def _eos_ids_with_generation_config(self, eos: int | None) -> list[int]:
        """The tokenizer's eos plus generation_config.json's (Llama 3 lists several)."""
        ids = [] if eos is None else [eos]
        gen = _read_json(os.path.join(self.model_dir, "generation_config.json")).get("eos_token_id")
        if not isinstance(gen, list):
            gen = [] if gen is None else [gen]
        for i in gen:
            if i not in ids:
                ids.append(i)
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None,
                            **template_kwargs) -> str:
        """Render `messages` with the model's template, as transformers does (tokenize=False):
        `tools` (OpenAI tool objects) and `template_kwargs` (e.g. Qwen3's enable_thinking) reach the
        template; `continue_final_message` leaves the last (assistant) message open, cut after its
        content. The result usually starts with the bos token: encode it with add_special_tokens=False."""
        if self.chat_template is None:
            raise ValueError(f"{self.model_dir} has no chat template (no 'chat_template' in "
                             f"tokenizer_config.json and no chat_template.jinja)")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set: "
                             "the first continues the last message, the second starts a new one")
        text = _compile_template(self.chat_template).render(
            {**self.special_tokens, **template_kwargs, "messages": messages, "tools": tools,
             "add_generation_prompt": add_generation_prompt})
        if continue_final_message:
            final = messages[-1]["content"] if messages and isinstance(messages[-1].get("content"), str) else ""
            for part in (final, final.strip()):
                if part in text:
                    return text[:text.rindex(part) + len(part)]
            raise ValueError("continue_final_message: the last message's content is not in the rendered chat")
        return text


class HFTokenizer(Tokenizer):
    """tokenizer.json read by the `tokenizers` library, which transformers' fast tokenizers wrap
    (importing transformers costs seconds of start-up). As transformers' generic fast tokenizer
    does: encode adds what tokenizer.json's post-processor adds; the special-token strings of
    tokenizer_config.json (or special_tokens_map.json) are special, so decode can skip them.
    Not followed: the add_bos_token / add_eos_token overrides of transformers' Llama-style
    classes, which rebuild the post-processor (Llama 2 and Mistral ship a tokenizer.json that
    already adds what their flags say)."""

    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer as RustTokenizer

        super().__init__(model_dir)
        self.tk = RustTokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        if self.tk.pre_tokenizer is None and hasattr(self.tk.model, "_resize_cache"):
            # No pre-tokenizer (sentencepiece-style BPE): the model's word cache keys whole texts,
            # which a server rarely sees twice; it would grow to 10,000 of them (~35 MiB resident
            # with the embedded model's, the soak's "leak") and encode slower, not faster.
            self.tk.model._resize_cache(0)
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        fallback = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
        self._special = {name: _token_text(self.config.get(name, fallback.get(name))) for name in names}
        self.tk.add_special_tokens([t for t in self._special.values() if t is not None])
        bos, eos = self._special["bos_token"], self._special["eos_token"]
        self.bos_token_id = None if bos is None else self.tk.token_to_id(bos)
        self.eos_token_ids = self._eos_ids_with_generation_config(None if eos is None else self.tk.token_to_id(eos))
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text, add_special_tokens=True):
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, text_1, text_2, add_special_tokens=True):
        # tokenizer.json's post-processor lays out the pair ("[CLS] A [SEP] B [SEP]", or A B)
        return self.tk.encode(text_1, text_2, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens=True):
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch, skip_special_tokens=True):
        # One call into the Rust library (in this thread: TOKENIZERS_PARALLELISM above).
        return self.tk.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        return [self.tk.id_to_token(i) for i in ids]

    @property
    def special_tokens(self):
        return dict(self._special)


class SentencePieceTokenizer(Tokenizer):
    """tokenizer.model read by sentencepiece itself. Control pieces (<s>, </s>, ...) are the
    special tokens: their strings in the text are encoded as those ids, as HF tokenizers do.
    Each stretch of text between them is encoded separately (HF's `legacy` behaviour)."""

    def __init__(self, model_dir: str):
        import sentencepiece as spm

        super().__init__(model_dir)
        self.sp = spm.SentencePieceProcessor(model_file=os.path.join(model_dir, "tokenizer.model"))
        self.vocab_size = self.sp.get_piece_size()
        self.special_ids = {i for i in range(self.vocab_size) if self.sp.is_control(i)}
        self.special_by_piece = {self.sp.id_to_piece(i): i for i in self.special_ids}
        pieces = sorted(self.special_by_piece, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, pieces)) + ")") if pieces else None
        self.bos_token_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_token_ids = self._eos_ids_with_generation_config(
            self.sp.eos_id() if self.sp.eos_id() >= 0 else None)
        self.add_bos = self.config.get("add_bos_token", True) and self.bos_token_id is not None
        self.add_eos = self.config.get("add_eos_token", False) and self.sp.eos_id() >= 0

    def encode(self, text, add_special_tokens=True):
        ids = [self.bos_token_id] if add_special_tokens and self.add_bos else []
        segments = self._special_re.split(text) if self._special_re else [text]
        for seg in segments:
            if seg in self.special_by_piece:
                ids.append(self.special_by_piece[seg])
            elif seg:
                ids += self.sp.encode(seg)
        if add_special_tokens and self.add_eos:
            ids.append(self.sp.eos_id())
        return ids

    def decode(self, ids, skip_special_tokens=True):
        # sentencepiece drops control pieces; keep their text between decoded stretches if asked.
        out, run = [], []
        for i in ids:
            if i in self.special_ids:
                if not skip_special_tokens:
                    out.append(self.sp.decode(run))
                    out.append(self.sp.id_to_piece(i))
                    run = []
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def convert_ids_to_tokens(self, ids):
        return [self.sp.id_to_piece(i) for i in ids]

    @property
    def special_tokens(self):
        def piece(i):
            return self.sp.id_to_piece(i) if i >= 0 else None
        return {"bos_token": piece(self.sp.bos_id()), "eos_token": piece(self.sp.eos_id()),
                "unk_token": piece(self.sp.unk_id()), "pad_token": piece(self.sp.pad_id())}


class IncrementalDetokenizer:
    """Streams text deltas for generated ids whose concatenation equals the full decode.

    Each step decodes only a short window: `prefix_offset:read_offset` is text already emitted
    (kept as left context so word-boundary spaces and byte pieces decode as they do in the
    full text), `read_offset:` is new. While the window's text ends in U+FFFD (an incomplete
    UTF-8 character) nothing is emitted. Call `flush()` when the sequence ends to emit anything
    still held back (an output that ends mid-character). `step_all` steps many detokenizers of one
    tokenizer with one decode_batch call (per skip_special_tokens setting): an engine step's rows."""

    CONTEXT = 5  # prompt tokens of left context, as vLLM
    # New ids a window holds back at most while they add no text (skipped special tokens, say):
    # then they are let go, so that the window does not grow with the output.
    MAX_HELD = 8

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-self.CONTEXT:])
        # Start the context on a character boundary: bytes of a character cut in two decode as
        # U+FFFD (HF's byte fallback even turns the whole run of byte pieces into U+FFFD).
        while self.ids and self._decode(self.ids).startswith("\ufffd"):
            del self.ids[0]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @staticmethod
    def _windows(detoks: list[IncrementalDetokenizer]) -> list[tuple[str, str]]:
        """Each detokenizer's (emitted context, whole window) texts, by one decode_batch call per
        skip_special_tokens setting. A context of one id (a decoding row's after its first step:
        the id before the new one) is the tokenizer's text of that id, decoded once: a step then
        decodes one window a row, not two."""
        texts: list[tuple[str, str]] = [("", "")] * len(detoks)
        for skip in {d.skip_special_tokens for d in detoks}:
            mine = [i for i, d in enumerate(detoks) if d.skip_special_tokens == skip]
            tokenizer = detoks[mine[0]].tokenizer
            known = tokenizer.id_texts[skip]
            contexts = [detoks[i].ids[detoks[i].prefix_offset:detoks[i].read_offset] for i in mine]
            cached = [known.get(c[0]) if len(c) == 1 else None for c in contexts]
            unknown = [c for c, text in zip(contexts, cached) if text is None]
            decoded = tokenizer.decode_batch(unknown + [detoks[i].ids[detoks[i].prefix_offset:] for i in mine], skip)
            for c, text in zip(unknown, decoded):
                if len(c) == 1:
                    known[c[0]] = text
            fresh, windows = iter(decoded), iter(decoded[len(unknown):])
            for i, text in zip(mine, cached):
                texts[i] = next(fresh) if text is None else text, next(windows)
        return texts

    @staticmethod
    def step_all(detoks: list[IncrementalDetokenizer], new_token_ids: list[list[int]]) -> list[str]:
        """Each detokenizer's `step` with its new ids."""
        for d, ids in zip(detoks, new_token_ids):
            d.ids.extend(ids)
        deltas = []
        for d, (prefix, text) in zip(detoks, IncrementalDetokenizer._windows(detoks)):
            held = ((text.endswith("\ufffd") and d._may_complete())
                    or (len(text) <= len(prefix) and len(d.ids) - d.read_offset < d.MAX_HELD))
            if not held:
                d._advance()
            deltas.append("" if held else text[len(prefix):])
        return deltas

    @staticmethod
    def step_runs(runs: dict, detoks: dict) -> dict[object, list[str]]:
        """Each key's new tokens' texts ({key: ids} in `runs`, {key: its detokenizer} in
        `detoks`), in one `step_all` per position of the runs (a call per row and token cost more
        than the rest of an engine step)."""
        texts = {k: [] for k in runs}
        for i in range(max(map(len, runs.values()), default=0)):
            keys = [k for k, ids in runs.items() if len(ids) > i]
            for k, text in zip(keys, IncrementalDetokenizer.step_all([detoks[k] for k in keys],
                                                                     [[runs[k][i]] for k in keys])):
                texts[k].append(text)
        return texts

    def _may_complete(self) -> bool:
        """Whether a window whose text ends in U+FFFD may still end in a character once more ids
        come. A character's unfinished bytes are at most 3, so yes while no more new ids are held;
        after that, only if a cut before one of the last 3 decodes clean (HF's byte fallback shows
        a whole run of byte pieces as U+FFFD while any is unfinished). Else the ids are not UTF-8
        (a model repeating a stray byte piece held a window for 1,000 steps, each decoding it all):
        they are sent as decoded, U+FFFD and all, as the full text shows them."""
        end = len(self.ids)
        return end - self.read_offset <= 3 or any(
            not self._decode(self.ids[self.prefix_offset:end - cut]).endswith("\ufffd") for cut in (1, 2, 3))

    def step(self, new_token_ids: list[int]) -> str:
        return self.step_all([self], [new_token_ids])[0]

    def flush(self) -> str:
        [(prefix, text)] = self._windows([self])
        self._advance()
        return text[len(prefix):]

    def _advance(self) -> None:
        # Drop ids left of the new window so memory and work stay O(window).
        del self.ids[:self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _read_chat_template(model_dir: str, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = {t["name"]: t["template"] for t in template}.get("default")
    jinja_file = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.exists(jinja_file):
        with open(jinja_file) as f:
            template = f.read()
    return template


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    # The environment transformers renders chat templates in.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
