"""Tokenizer backends, chat templates and the incremental detokenizer.

Two tokenizers are built here from a short text (no downloads): a Llama-style sentencepiece
model (dummy-prefix spaces, byte fallback) and a GPT-2-style byte-level BPE tokenizer.json.
The embedded tiny model's tokenizer is checked through both of its files.
"""
import json
import os
import random
import shutil

import pytest
import sentencepiece as spm
from tokenizers import Tokenizer as HFRustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from jaxserve.server import validation
from jaxserve.tokenizer import (HFTokenizer, IncrementalDetokenizer, SentencePieceTokenizer,
                                load_tokenizer)

TINY_DIR = os.path.join(os.path.dirname(__file__), "..", "jaxserve", "assets", "tiny")

TRAIN_TEXT = """The quick brown fox jumps over the lazy dog. Python is a programming language.
A function returns a value; a generator yields values. Streams of tokens become text again.
Les élèves naïfs mangent des crêpes au café. Übermäßig schöne Grüße aus Köln.
中文字符在这里出现。这是一个测试句子，用于训练分词器。
    def square(x):
        return x * x
""" * 3

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "中文字符测试，这是一个句子。",
    "Emoji 🎉👍🏽 and a flag 🇫🇷 in café, naïve, résumé, Ångström.",
    "  def f(x):\n\treturn x ** 2  # 🐍 snake\n",
    "mixed 日本語 text, ümlauts and 한국어 (never seen in training).",
]

CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'You are helpful.' %}{%- endif %}"
    "{{ bos_token }}<|im_start|>system\n{{ system }}<|im_end|>\n"
    "{%- for m in messages %}\n"
    "    {%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}\n"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{%- endfor %}\n"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is a generator?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "  Héllo 🎉  "},
     {"role": "assistant", "content": "Hi."},
     {"role": "user", "content": "Tell me about for loops."}],
]


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    corpus = d / "corpus.txt"
    corpus.write_text(TRAIN_TEXT)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(d / "tokenizer"), vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, hard_vocab_limit=False,
        num_threads=1, minloglevel=2)
    corpus.unlink()
    (d / "tokenizer.vocab").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return str(d)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    tok = HFRustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN_TEXT.splitlines(), trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>", "clean_up_tokenization_spaces": True, "chat_template": CHATML}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return str(d)


@pytest.fixture(scope="module")
def tiny_spm_only(tmp_path_factory):
    """The embedded tokenizer without its tokenizer.json: the sentencepiece backend."""
    d = tmp_path_factory.mktemp("tiny_spm")
    for fn in ("tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(TINY_DIR, fn), d / fn)
    return str(d)


BACKENDS = ["spm", "hf", "tiny_hf", "tiny_spm"]


@pytest.fixture(params=BACKENDS)
def tokenizer(request, spm_dir, hf_dir, tiny_spm_only):
    path = {"spm": spm_dir, "hf": hf_dir, "tiny_hf": TINY_DIR, "tiny_spm": tiny_spm_only}[request.param]
    return load_tokenizer(path)


def test_backend_choice(spm_dir, hf_dir, tiny_spm_only):
    assert isinstance(load_tokenizer(spm_dir), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(tiny_spm_only), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(hf_dir), HFTokenizer)
    assert isinstance(load_tokenizer(TINY_DIR), HFTokenizer)  # tokenizer.json wins


def test_missing_tokenizer_names_dir_and_files(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(e.value)
    assert "tokenizer.json" in str(e.value) and "tokenizer.model" in str(e.value)


def test_roundtrip_and_byte_fallback(tokenizer):
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    if isinstance(tokenizer, SentencePieceTokenizer):
        # Emoji are not in the vocabulary: they must come out as byte pieces, not <unk>.
        ids = tokenizer.encode("🎉👍🏽", add_special_tokens=False)
        assert sum(tokenizer.sp.is_byte(i) for i in ids) == 12  # 3 emoji code points x 4 bytes
        assert tokenizer.sp.unk_id() not in ids


# tokenizer_config.json variants: what transformers reads besides tokenizer.json (its generic
# fast tokenizer leaves the bos/eos that encode adds to tokenizer.json, whatever the flags say).
CONFIG_VARIANTS = {
    "as_saved": {},
    "bos_and_eos_flags": {"add_bos_token": True, "add_eos_token": True},
    "added_token_dicts": {"bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True}, "add_bos_token": True},
}


@pytest.mark.parametrize("variant", CONFIG_VARIANTS)
def test_hf_backend_matches_transformers(hf_dir, tmp_path, variant):
    """Ours reads tokenizer.json without transformers; its encode, decode, special tokens and
    eos ids must still be transformers'."""
    shutil.copytree(hf_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text()) | CONFIG_VARIANTS[variant]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for path in (str(tmp_path), TINY_DIR):
        ours, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        for text in TEXTS + ["a<|im_start|>b<|im_end|>", "<s>x</s>"]:
            for special in (True, False):
                assert ours.encode(text, special) == ref.encode(text, add_special_tokens=special), text
            ids = ref.encode(text)
            for skip in (True, False):
                # Ours never cleans up tokenization spaces (the config asks transformers to).
                assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip,
                                                            clean_up_tokenization_spaces=False)
        assert ours.special_tokens == {name: getattr(ref, name) for name in ours.special_tokens}
        assert ours.bos_token_id == ref.bos_token_id and ours.vocab_size == len(ref)
    ours, ref = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.eos_token_ids == [ref.eos_token_id, 0]  # generation_config adds id 0


def test_embedded_backends_agree(tiny_spm_only):
    """tokenizer.model through sentencepiece == tokenizer.json through transformers."""
    sp, hf = load_tokenizer(tiny_spm_only), load_tokenizer(TINY_DIR)
    chat = hf.apply_chat_template(CONVERSATIONS[1])
    texts = TEXTS + [chat, "a<s>b</s>c<|user|>", " leading and trailing spaces  ", "x = 1234567.89"]
    for text in texts:
        for special in (True, False):
            assert sp.encode(text, special) == hf.encode(text, special), text
        ids = hf.encode(text)
        for skip in (True, False):
            assert sp.decode(ids, skip) == hf.decode(ids, skip)
    assert sp.apply_chat_template(CONVERSATIONS[1]) == chat
    assert (sp.bos_token_id, sp.eos_token_ids, sp.vocab_size) == (hf.bos_token_id, hf.eos_token_ids, hf.vocab_size)
    assert sp.convert_ids_to_tokens(hf.encode(chat)) == hf.convert_ids_to_tokens(hf.encode(chat))


def test_pairs_match_transformers(hf_dir, tiny_spm_only):
    """encode_pair (a cross-encoder's prompt) == transformers' tokenizer(text_1, text_2): the
    tokenizer.json backend (its post-processor's pair) and the sentencepiece one."""
    for path in (hf_dir, TINY_DIR, tiny_spm_only):
        ours, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        for a, b in zip(TEXTS, TEXTS[1:]):
            assert ours.encode_pair(a, b) == ref(a, b)["input_ids"], (path, a, b)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(hf_dir, spm_dir, conversation, add_generation_prompt):
    for path in (hf_dir, TINY_DIR):
        expected = AutoTokenizer.from_pretrained(path).apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert load_tokenizer(path).apply_chat_template(conversation, add_generation_prompt) == expected
    # The sentencepiece backend renders the same template with its own special-token strings.
    rendered = load_tokenizer(spm_dir).apply_chat_template(conversation, add_generation_prompt)
    assert rendered.startswith("<s><|im_start|>system\n") and rendered.endswith(
        "<|im_start|>assistant\n" if add_generation_prompt else "<|im_end|>")


def test_chat_template_errors(hf_dir, tmp_path):
    with pytest.raises(Exception, match="bad role tool"):
        load_tokenizer(hf_dir).apply_chat_template([{"role": "tool", "content": "x"}])
    shutil.copy(os.path.join(hf_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(str(tmp_path)).apply_chat_template(CONVERSATIONS[0])


# Qwen-style: tools in the system turn, an assistant's calls, tool answers, a thinking switch.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Köln?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Köln"}}}]},
    {"role": "tool", "content": "12 °C", "tool_call_id": "c1"},
    {"role": "assistant", "content": "It is 12"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Current weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("options", [dict(add_generation_prompt=True, enable_thinking=False),
                                     dict(add_generation_prompt=True, enable_thinking=True),
                                     dict(add_generation_prompt=False, continue_final_message=True)])
def test_chat_template_tools_and_options_match_transformers(hf_dir, tmp_path, options):
    shutil.copy(os.path.join(hf_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": TOOLS_TEMPLATE}))
    expected = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        TOOL_CONVERSATION, tools=TOOLS, tokenize=False, **options)
    assert load_tokenizer(str(tmp_path)).apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, **options) == expected
    assert '"name": "weather"' in expected and ("<think>" in expected) == (options.get("enable_thinking") is False)
    assert expected.endswith("It is 12") == bool(options.get("continue_final_message"))


# The two ways templates read an assistant's earlier reasoning: Qwen3's and gpt-oss's.
REASONING_TEMPLATE = ("{%- for m in messages %}{{ m.role }}:{% if m.reasoning_content is string %}<think>"
                      "{{ m.reasoning_content }}</think>{% endif %}{% if m.thinking %}[{{ m.thinking }}]{% endif %}"
                      "{{ m.content }}|{% endfor %}")


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_chat_messages_keep_an_assistants_reasoning(hf_dir, tmp_path, key):
    shutil.copy(os.path.join(hf_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": REASONING_TEMPLATE}))
    body = {"messages": [{"role": "user", "content": "2+2?", key: "not an assistant's"},
                         {"role": "assistant", "content": "4", key: "Adding."},
                         {"role": "user", "content": "And 3+3?"}]}
    tokenizer = load_tokenizer(str(tmp_path))
    text = tokenizer.apply_chat_template(validation.messages(body), add_generation_prompt=False)
    assert text == "user:2+2?|assistant:<think>Adding.</think>[Adding.]4|user:And 3+3?|"


def stream(tokenizer, prompt, output, skip, rng):
    """Feed `output` to a detokenizer in random chunks of 1-3 ids; return the deltas."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(output):
        n = rng.randint(1, 3)
        deltas.append(detok.step(output[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_real_text(tokenizer, skip):
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        deltas = stream(tokenizer, [], ids, skip, rng)
        assert "".join(deltas) == tokenizer.decode(ids, skip)
        assert not any("\ufffd" in d for d in deltas)  # never half a character
        # With a prompt: the deltas are the text the output adds to the prompt's text.
        for cut in range(1, len(ids)):
            prompt_text, full = tokenizer.decode(ids[:cut], skip), tokenizer.decode(ids, skip)
            if "\ufffd" in prompt_text:
                continue  # the prompt ends inside a character
            deltas = stream(tokenizer, ids[:cut], ids[cut:], skip, rng)
            assert "".join(deltas) == full[len(prompt_text):]
            assert not any("\ufffd" in d for d in deltas)


def random_ids(tokenizer, rng, n):
    """Random ids. HF's byte fallback decodes a run of byte pieces holding any invalid UTF-8 as
    all U+FFFD, which no stream can know in advance; there, byte pieces come as whole characters."""
    if not isinstance(tokenizer, HFTokenizer) or "<0xE4>" not in tokenizer.tk.get_vocab():
        return [rng.randrange(tokenizer.vocab_size) for _ in range(n)]
    byte_ids = {tokenizer.tk.token_to_id(f"<0x{b:02X}>") for b in range(256)}
    ids = []
    while len(ids) < n:
        i = rng.randrange(tokenizer.vocab_size)
        if i in byte_ids:
            char = chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x4E00, 0x9FFF), rng.randrange(0x1F300, 0x1F64F)]))
            ids += [tokenizer.tk.token_to_id(f"<0x{b:02X}>") for b in char.encode()]
        else:
            ids.append(i)
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_random_ids(tokenizer, skip):
    rng = random.Random(1)
    for _ in range(40):
        ids = random_ids(tokenizer, rng, rng.randint(1, 60))
        assert "".join(stream(tokenizer, [], ids, skip, rng)) == tokenizer.decode(ids, skip)


def test_detokenizer_work_is_bounded(tokenizer):
    """Each step decodes a short window, however long the output grows."""
    ids = tokenizer.encode(" ".join(TEXTS * 8))
    widths, calls = [], []
    decode_batch = tokenizer.decode_batch
    tokenizer.decode_batch = lambda windows, skip: (calls.append(len(windows)) or widths.extend(map(len, windows))
                                                    or decode_batch(windows, skip))
    detok = IncrementalDetokenizer(tokenizer, ids[:50])
    text = "".join(detok.step([i]) for i in ids[50:]) + detok.flush()
    del tokenizer.decode_batch
    assert len(ids) > 400 and max(widths) <= 16
    assert calls.count(1) > len(calls) // 2   # a context of one id met before: its text is known (_windows)
    assert text == tokenizer.decode(ids)[len(tokenizer.decode(ids[:50])):]


def test_detokenizer_sends_stray_bytes_without_growing(tokenizer):
    """A model repeating a byte piece that starts a UTF-8 character (a greedy random model did,
    for 1,000 steps): the window lets go of ids that cannot become a character, sends U+FFFD as
    the full decode shows it, and stays short."""
    stray = tokenizer.encode("\uc548")[-3]   # 0xEC, the lead byte of a 3-byte character
    if tokenizer.decode([stray]) != "\ufffd":
        pytest.skip("no byte piece for 0xEC")
    widths = []
    decode_batch = tokenizer.decode_batch
    tokenizer.decode_batch = lambda windows, skip: widths.extend(map(len, windows)) or decode_batch(windows, skip)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hello"))
    deltas = [detok.step([stray]) for _ in range(100)]
    del tokenizer.decode_batch
    assert max(widths) <= IncrementalDetokenizer.CONTEXT + IncrementalDetokenizer.MAX_HELD
    assert sum(map(bool, deltas)) >= 100 // IncrementalDetokenizer.MAX_HELD   # the stream keeps moving
    assert "".join(deltas) + detok.flush() == tokenizer.decode([stray] * 100)


def test_detokenizers_stepped_together_match_the_full_decode(tokenizer):
    """step_all, as the engine steps its rows: one decode_batch call per skip_special_tokens
    setting, and each output's deltas add up to its full decode."""
    rng = random.Random(2)
    outputs = [random_ids(tokenizer, rng, rng.randint(1, 40)) for _ in range(8)]
    skips = [i % 2 == 0 for i in range(8)]
    detoks = [IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip) for skip in skips]
    texts, calls = [""] * 8, []
    decode_batch = tokenizer.decode_batch
    tokenizer.decode_batch = lambda windows, skip: calls.append(skip) or decode_batch(windows, skip)
    for step in range(max(map(len, outputs))):
        live = [i for i in range(8) if step < len(outputs[i])]
        calls.clear()
        deltas = IncrementalDetokenizer.step_all([detoks[i] for i in live], [[outputs[i][step]] for i in live])
        assert sorted(calls) == sorted({skips[i] for i in live})
        for i, delta in zip(live, deltas):
            texts[i] += delta
    del tokenizer.decode_batch
    assert [text + d.flush() for text, d in zip(texts, detoks)] == [tokenizer.decode(o, s) for o, s in zip(outputs, skips)]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_distinct_prompts_do_not_grow_memory():
    """The embedded tokenizer has no pre-tokenizer: the `tokenizers` word cache would key whole
    prompts and hold 10,000 of them (it grew resident memory 13 MiB over 4,000 prompts, measured
    against the raw library); our wrapper turns it off, so distinct prompts cost nothing kept."""
    tok = HFTokenizer(TINY_DIR)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
    rng = random.Random(0)
    texts = [" ".join(rng.choices(words, k=rng.randint(2, 30))) for _ in range(4000)]
    tok.encode(texts[0])
    before = _rss_mib()
    for text in texts:
        tok.encode(text)
    assert _rss_mib() - before < 3
