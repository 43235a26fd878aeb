"""The offline API (`from jaxserve import LLM, SamplingParams`) on the embedded tiny model:
every prompt form, one or per-prompt SamplingParams, logprobs in vLLM's shape, chat, the README
example; greedy tokens against transformers and against the engine stepped directly."""
import contextlib
import io
import os
import re
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxserve import LLM, SamplingParams
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.sampling_params import InvalidRequest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The README example's settings (so its run reuses these tests' compiled steps): few buckets.
ENGINE = dict(max_model_len=512, kv_cache_mb=64, max_num_seqs=8, max_num_batched_tokens=64,
              compilation_cache_dir=os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache"))
PROMPTS = ["The try statement specifies", "Lists are mutable sequences", "def f(x):\n    return"]
NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(model=None, **ENGINE)


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()


def hf_greedy(hf, ids: list[int], n: int = NEW) -> list[int]:
    """n argmax tokens from transformers' forward pass (eos not special)."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.fixture(scope="module")
def reference(llm, hf):
    """Each prompt's token ids (transformers' tokenizer) and transformers' greedy tokens."""
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    ids = [tok.encode(p) for p in PROMPTS]
    return ids, [hf_greedy(hf, i) for i in ids]


def test_greedy_matches_transformers_and_the_engine(llm, reference):
    ids, want = reference
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS and [o.prompt_token_ids for o in outs] == ids
    assert [o.outputs[0].token_ids for o in outs] == want
    tokenizer = llm.get_tokenizer()
    for o in outs:
        (c,) = o.outputs
        assert o.finished and c.finished() and c.finish_reason == "length" and c.index == 0
        assert c.text == tokenizer.decode(c.token_ids) and c.logprobs is None
    # The engine stepped directly gives the same tokens.
    engine = llm.llm_engine
    rids = [engine.add_request(i, GREEDY) for i in ids]
    direct = {r: [] for r in rids}
    while engine.has_unfinished():
        for delta in engine.step():
            direct[delta.request_id] += delta.outputs[0].token_ids
    assert [direct[r] for r in rids] == want


def test_the_next_turn_finds_all_the_last_one_computed_cached(llm, reference):
    """A prompt that goes on from an ended request (a conversation's next turn) finds every token
    that request computed in the prefix cache, its last, partly filled page too: all but its last
    sampled token. RequestOutput.num_cached_tokens says so, as vLLM's."""
    ids, want = reference
    first = ids[0] * 3   # longer than a page
    (out,) = llm.generate([first], GREEDY, use_tqdm=False)
    page = llm.llm_engine.ecfg.page_size
    computed = len(first) + NEW - 1
    assert computed % page, "the first turn should end inside a page"
    (turn,) = llm.generate([first + out.outputs[0].token_ids + ids[1]], GREEDY, use_tqdm=False)
    assert turn.num_cached_tokens == computed


def test_every_prompt_form(llm, reference):
    ids, want = reference
    (one,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)   # a single string
    assert one.outputs[0].token_ids == want[0]
    (one,) = llm.generate(ids[1], GREEDY, use_tqdm=False)       # a single list of token ids
    assert one.prompt is None and one.prompt_token_ids == ids[1] and one.outputs[0].token_ids == want[1]
    (one,) = llm.generate({"prompt": PROMPTS[2]}, use_tqdm=False,
                          sampling_params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert one.prompt == PROMPTS[2] and one.outputs[0].token_ids == want[2][:3]
    # A list of every form, with one SamplingParams per prompt.
    forms = [{"prompt_token_ids": ids[2]}, ids[0], PROMPTS[1], {"prompt": PROMPTS[0]}]
    lengths = [5, 2, NEW, 7]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(forms, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[2][:5], want[0][:2], want[1], want[0][:7]]
    assert [o.prompt for o in outs] == [None, None, PROMPTS[1], PROMPTS[0]]
    assert len({o.request_id for o in outs}) == 4
    with pytest.raises(ValueError, match="2 sampling params for 4 prompts"):
        llm.generate(forms, params[:2], use_tqdm=False)


def test_requests_are_checked_before_any_runs(llm):
    engine = llm.llm_engine
    steps = engine.stats["steps"]
    with pytest.raises(InvalidRequest, match="prompt 1: prompt token ids out of range"):
        llm.generate(["fine", [5, 10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="prompt 0: .*maximum context length is 512"):
        llm.generate([[5] * 505], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequest, match="prompt 0: expected a string"):
        llm.generate([{"text": "x"}], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature must be between 0 and 2"):
        SamplingParams(temperature=2.5)
    assert engine.stats["steps"] == steps and not engine.has_unfinished()


def test_truncation_and_max_tokens_none_resolve_per_prompt():
    """vLLM's meanings: truncate_prompt_tokens -1 keeps the context length's worth of the prompt;
    max_tokens None runs to the end of the context left after truncation."""
    ids, resolved = SamplingParams(truncate_prompt_tokens=-1, max_tokens=None).resolve(list(range(600)), 512)
    assert ids == list(range(88, 600)) and resolved.max_tokens == 1
    ids, resolved = SamplingParams(truncate_prompt_tokens=100, max_tokens=None).resolve(list(range(600)), 512)
    assert ids == list(range(500, 600)) and resolved.max_tokens == 412
    assert SamplingParams(max_tokens=7).resolve([1, 2], 512) == ([1, 2], SamplingParams(max_tokens=7))
    with pytest.raises(InvalidRequest, match="min_tokens"):   # 3 > the single token left
        SamplingParams(truncate_prompt_tokens=-1, max_tokens=None, min_tokens=3).resolve(list(range(600)), 512)


def test_prompt_logprobs_in_vllm_shape_match_transformers(llm, hf, reference):
    """SamplingParams(prompt_logprobs=N): None for the first prompt token, then each prompt token's
    logprob, rank and the top-N, from transformers' log-softmax in f32; max_tokens 0 scores only."""
    ids = reference[0][1]
    outs = llm.generate([ids, ids], [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2),
                                     SamplingParams(max_tokens=0, prompt_logprobs=0)], use_tqdm=False)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    assert outs[1].outputs[0].token_ids == [] and outs[1].outputs[0].finish_reason == "length"
    for out, n in zip(outs, (2, 0)):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for row, token, entry in zip(ref, ids[1:], out.prompt_logprobs[1:]):
            top = torch.topk(row, n).indices.tolist()
            assert list(entry) == [token] + [t for t in top if t != token]
            assert entry[token].rank == 1 + int((row > row[token]).sum())
            assert all(abs(lp.logprob - row[t].item()) < 1e-4 for t, lp in entry.items())


def test_logprobs_in_vllm_shape_match_transformers(llm, hf, reference):
    ids, want = reference
    (out,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == want[0][:4] and len(c.logprobs) == 4
    with torch.no_grad():
        logits = hf(torch.tensor([ids[0] + c.token_ids])).logits[0, len(ids[0]) - 1:-1].double()
    ref = torch.log_softmax(logits, -1)
    tokenizer = llm.get_tokenizer()
    for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        top = torch.topk(ref[step], 3).indices.tolist()
        assert list(entry) == top and top[0] == token   # greedy: the sampled token is the top one
        for rank, t in enumerate(top, 1):
            assert entry[t].rank == rank and abs(entry[t].logprob - ref[step, t].item()) < 1e-4
            assert entry[t].decoded_token == tokenizer.decode([t], skip_special_tokens=False)


def test_chat_applies_the_template(llm, hf):
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    conversations = [[{"role": "user", "content": "Tell me about the while statement."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False)
    for conv, out in zip(conversations, outs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert out.prompt_token_ids == ids and out.prompt == tok.decode(ids)
        assert out.outputs[0].token_ids == hf_greedy(hf, ids)
    (one,) = llm.chat(conversations[0], GREEDY, use_tqdm=False)   # one conversation
    assert one.outputs[0].token_ids == outs[0].outputs[0].token_ids
    # The assistant's last message continued (the embedded template ends each message with </s>)
    started = conversations[0] + [{"role": "assistant", "content": "A while loop"}]
    (cont,) = llm.chat(started, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    ids = tok.apply_chat_template(started, continue_final_message=True, tokenize=True, return_dict=False)
    assert cont.prompt_token_ids == ids and cont.prompt.endswith("A while loop")


def test_readme_offline_example_runs(hf):
    """The python block of README.md's "Offline batch inference" section, run as written: its
    first line of output is transformers' greedy continuation of its first prompt."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    section = readme.split("## Offline batch inference", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    lines = stdout.getvalue().splitlines()
    prompt = re.search(r'prompts = \[\s*"([^"]+)"', code).group(1)
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    ids = tok.encode(prompt)
    max_tokens = int(re.search(r"max_tokens=(\d+)", code).group(1))
    want = hf_greedy(hf, ids, max_tokens)
    if tok.eos_token_id in want:   # generate stops at eos
        want = want[:want.index(tok.eos_token_id)]
    from jaxserve.tokenizer import load_tokenizer
    assert lines[0] == f"{prompt!r} -> {load_tokenizer(TINY_MODEL_DIR).decode(want)!r}"
    assert len(lines) >= 3


def test_generation_config_sampling_defaults_read_as_transformers_diff(tmp_path):
    """The fields vLLM takes from generation_config.json: those transformers' GenerationConfig
    holds apart from its defaults (to_diff_dict; with transformers 5, every value written), the
    sampling ones; "none" takes none."""
    from transformers import GenerationConfig

    from jaxserve.sampling_params import sampling_defaults

    written = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
               "max_new_tokens": 5, "eos_token_id": [1, 2]}
    for i, gen in enumerate([written, {"top_k": 50, "min_p": 0.1, "do_sample": True}]):
        d = tmp_path / str(i)
        GenerationConfig(**gen).save_pretrained(d)
        diff = GenerationConfig.from_pretrained(d).to_diff_dict()
        expected = {k: diff[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in diff}
        assert sampling_defaults(str(d)) == expected and sampling_defaults(str(d), "none") == {}
        assert expected and SamplingParams(**sampling_defaults(str(d))) != SamplingParams()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text('{"temperature": 5.0}')
    with pytest.raises(ValueError, match="generation_config.json: temperature must be between 0 and 2"):
        sampling_defaults(str(tmp_path / "bad"))
