"""The offline API, as vLLM users write it:

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="/path/to/hf-model", max_model_len=2048)
    for out in llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32)):
        print(out.outputs[0].text)

`LLM` steps one engine (jaxserve.factory.build_engine) in the caller's thread until every
request has finished, and returns each request's final output in input order.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Union

from jaxserve import beam_search, scoring
from jaxserve.config import EngineConfig
from jaxserve.sampling_params import InvalidRequest, LoRARequest, PoolingParams, SamplingParams, sampling_defaults

if TYPE_CHECKING:
    from jaxserve.runner import SampleResult

# A prompt: text, token ids, {"prompt_token_ids": [...]} or {"prompt": "..."}.
Prompt = Union[str, list[int], dict]


@dataclasses.dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None            # 1 = the most likely token; None when not among the top-N
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One choice, complete."""
    index: int
    text: str
    token_ids: list[int]
    # Per generated token, {token id: Logprob} for the sampled token and the top-N (when the
    # request asked for logprobs), else None.
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None          # 'stop' | 'length'

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None                 # None when the prompt was given as token ids only
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then per prompt token
    # {token id: Logprob} for that token and the top-N (vLLM's shape).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0         # prompt tokens found in the prefix cache (vLLM's)


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """vLLM's: `outputs.embedding` is the prompt's pooled (and by default normalized) hidden state."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]   # one per label (config.json's id2label order)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    """vLLM's: `outputs.probs`, the softmax of a sequence classifier's label logits (one label: its sigmoid)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """vLLM's: `outputs.score` of one pair (jaxserve/scoring.py); prompt_token_ids the pair's prompt
    (a cross-encoder's) or its two texts' prompts one after the other (an embedding model's)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


class LLM:
    """`LLM(model=DIR, **EngineConfig fields)`; model None is the embedded tiny model."""

    def __init__(self, model: str | None = None, **engine_config):
        from jaxserve.factory import build_engine

        cfg = EngineConfig(model=model, **engine_config)
        if cfg.distributed is not None or cfg.mesh.get("data", 1) > 1:
            raise ValueError("LLM runs one engine in this process; multi-host and data-parallel "
                             "engines serve through `jaxserve serve`")
        self.llm_engine = build_engine(cfg)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def load_weights(self, weights) -> int:
        """New weights, in place, between calls: (Hugging Face tensor name, tensor) pairs, any
        subset of the model's, from torch, numpy or JAX arrays (vLLM's model.load_weights; what an
        RL trainer does between rollouts). No recompilation; the prefix cache is forgotten. The
        number of tensors loaded (jaxserve/weight_update.py)."""
        from jaxserve.weight_update import update_engine

        return update_engine(self.llm_engine, weights)

    def sleep(self, level: int = 1) -> None:
        """vLLM's: give the accelerator memory back between calls (an RL trainer colocated with
        the engine trains meanwhile). Level 1 copies the weights to host memory, level 2 drops
        them (wake_up(tags=["weights"]), then load_weights with the full set, before generating);
        the KV cache is dropped, the prefix cache forgotten. Refused while requests run
        (jaxserve/sleep_mode.py)."""
        from jaxserve import sleep_mode

        sleep_mode.sleep(self.llm_engine, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: the buffers of `tags` ("weights", "kv_cache"; None: both) as they were before
        sleep, so nothing recompiles; generate is refused until both are awake."""
        from jaxserve import sleep_mode

        sleep_mode.wake_up(self.llm_engine, tags)

    def is_sleeping(self) -> bool:
        """vLLM's: whether any of the weights and the KV cache sleeps."""
        return bool(self.llm_engine.sleeping)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's); False while requests hold pages."""
        return self.llm_engine.block_manager.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use without sampling params: the model's generation_config.json
        settings (EngineConfig.generation_config), the rest SamplingParams' defaults."""
        engine = self.llm_engine
        return SamplingParams(**sampling_defaults(engine.model_dir, engine.ecfg.generation_config))

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """One prompt or a list; one SamplingParams for all, or one per prompt; one LoRA adapter
        for all, or one (or None: the base model) per prompt. Every request is checked before any
        runs (InvalidRequest names the prompt at fault)."""
        prompts, params = self._per_prompt(prompts, sampling_params if sampling_params is not None
                                           else self.get_default_sampling_params())
        params = self._with_loras(params, lora_request)
        parsed = [self._parse(p, i) for i, p in enumerate(prompts)]
        return self._run([text for text, _ in parsed], [ids for _, ids in parsed], params, use_tqdm)

    def beam_search(self, prompts: list[Prompt], params: beam_search.BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[beam_search.BeamSearchOutput]:
        """vLLM's: each prompt's beam_width best sequences, best first (jaxserve/beam_search.py);
        a sequence's `tokens` and `text` are the prompt's and the generated ones, its `logprobs`
        per generated token {token id: Logprob} of the candidates it was chosen from."""
        engine = self.llm_engine
        round_params = self._with_loras([beam_search.round_params(
            SamplingParams(), beam_search.num_candidates(params, engine.eos_token_ids))], lora_request)[0]

        def next_tokens(batch: list[list[int]]) -> list[list[tuple[int, float]]]:
            requests = self._requests(batch, [round_params] * len(batch))
            tops = {d.request_id: c.logprobs[0].top for d in self._step_all(requests, "beam search", False)
                    for c in d.outputs if c.logprobs}
            return [tops[r.request_id] for r in requests]

        decode = self.get_tokenizer().decode
        results = beam_search.search([self._parse(p, i)[1] for i, p in enumerate(prompts)], params,
                                     engine.eos_token_ids, engine.max_model_len, next_tokens)
        for beams in results:
            for b in beams:
                b.text = decode(b.tokens)
                b.logprobs = [{t: Logprob(lp, rank, decode([t], skip_special_tokens=False))
                               for rank, (t, lp) in enumerate(top.items(), 1)} for top in b.logprobs]
        return [beam_search.BeamSearchOutput(beams) for beams in results]

    def embed(self, prompts: Prompt | list[Prompt], pooling_params: PoolingParams | list[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (an engine with runner pooling: jaxserve/pooling.py); prompts and
        params as generate's."""
        prompts, params = self._per_prompt(prompts, pooling_params or PoolingParams())
        ids = [self._parse(p, i)[1] for i, p in enumerate(prompts)]
        return [EmbeddingRequestOutput(req.request_id, req.prompt_token_ids, EmbeddingOutput(v))
                for req, v in self._pool(ids, params, "embed", use_tqdm)]

    def classify(self, prompts: Prompt | list[Prompt],
                 pooling_params: PoolingParams | list[PoolingParams] | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (a sequence classifier: jaxserve/pooling.py); prompts and
        params as generate's."""
        prompts, params = self._per_prompt(prompts, pooling_params or PoolingParams())
        ids = [self._parse(p, i)[1] for i, p in enumerate(prompts)]
        return [ClassificationRequestOutput(req.request_id, req.prompt_token_ids,
                                            ClassificationOutput(scoring.probabilities(logits)))
                for req, logits in self._pool(ids, params, "classify", use_tqdm)]

    def score(self, data_1: str | list[str], data_2: str | list[str], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """data_1's texts scored against data_2's, 1:1, 1:N or N:N (jaxserve/scoring.py): a
        cross-encoder's sigmoid of each pair's logit, or an embedding model's cosine similarities."""
        text_1, text_2 = ([d] if isinstance(d, str) else list(d) for d in (data_1, data_2))
        run = scoring.score_run(self.llm_engine.pooler, self.get_tokenizer(), text_1, text_2)
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        pooled = self._pool(run.prompts, [params] * len(run.prompts), run.task, use_tqdm)
        return [ScoringRequestOutput("_".join(pooled[i][0].request_id for i in read),
                                     [t for i in read for t in pooled[i][0].prompt_token_ids], ScoringOutput(score))
                for read, score in zip(run.scored, run.scores([v for _, v in pooled]))]

    @staticmethod
    def _per_prompt(prompts, params) -> tuple[list, list]:
        """One prompt or a list, and params for all or one per prompt: as lists of equal length."""
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                      and all(isinstance(t, int) for t in prompts))
        prompts = [prompts] if single else list(prompts)
        if not isinstance(params, list):
            return prompts, [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return prompts, params

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One conversation ([{"role", "content"}, ...]) or a list of them, through the model's
        chat template: the assistant's turn to come, or (continue_final_message, with
        add_generation_prompt=False) the last message continued; `tools` and
        `chat_template_kwargs` reach the template; `lora_request` as generate's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt, continue_final_message, tools,
                                               **(chat_template_kwargs or {})) for c in conversations]
        # The template writes any bos itself.
        return self.generate([{"prompt": t, "prompt_token_ids": tokenizer.encode(t, add_special_tokens=False)}
                              for t in texts], sampling_params, use_tqdm, lora_request)

    def _with_loras(self, params: list[SamplingParams], requests) -> list[SamplingParams]:
        """`params` on their prompts' adapters, made known to the engine (loaded into a slot when a
        request runs; beyond max_loras adapters, requests wait for one)."""
        requests = requests if isinstance(requests, list) else [requests] * len(params)
        if len(requests) != len(params):
            raise ValueError(f"{len(requests)} LoRA requests for {len(params)} prompts")
        adapters = self.llm_engine.loras
        named = {r.lora_name: r for r in requests if r is not None}
        if named and adapters is None:
            raise ValueError("a lora_request needs an engine with LoRA enabled: LLM(..., enable_lora=True)")
        for r in named.values():
            adapters.register(r)
        # each distinct (params, adapter) built once: building SamplingParams checks its grammar
        pairs = {(id(p), r.lora_name): (p, r.lora_name) for p, r in zip(params, requests) if r is not None}
        on_adapter = {key: dataclasses.replace(p, lora_name=name) for key, (p, name) in pairs.items()}
        return [p if r is None else on_adapter[id(p), r.lora_name] for p, r in zip(params, requests)]

    def _parse(self, prompt: Prompt, i: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer().encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequest(f"prompt {i}: expected a string, a list of token ids, {{'prompt_token_ids': "
                             f"[...]}} or {{'prompt': '...'}}, got {type(prompt).__name__}", param="prompt")

    def _requests(self, ids: list[list[int]], params: list) -> list:
        """The engine's checked requests (InvalidRequest names the prompt at fault), none added yet."""
        requests = []
        for i, (p, sp) in enumerate(zip(ids, params)):
            try:
                requests.append(self.llm_engine.new_request(p, sp))
            except InvalidRequest as e:
                raise InvalidRequest(f"prompt {i}: {e}", param=e.param) from None
        return requests

    def _pool(self, ids: list[list[int]], params: list[PoolingParams], task: str, use_tqdm: bool) -> list[tuple]:
        """(request, its pooled output: an embedding or label logits) for each prompt, in order, each
        params' task set to `task` ("embed" or "classify")."""
        requests = self._requests(ids, [dataclasses.replace(p, task=task) for p in params])
        pooled = {delta.request_id: delta.pooled for delta in self._step_all(requests, task, use_tqdm)
                  if delta.pooled is not None}
        return [(req, pooled[req.request_id]) for req in requests]

    def _step_all(self, requests: list, desc: str, use_tqdm: bool):
        """Add `requests` and step the engine until all have finished, yielding each output delta."""
        from tqdm import tqdm

        engine = self.llm_engine
        for req in requests:
            engine.add(req)
        with tqdm(total=len(requests), desc=desc, disable=not use_tqdm, unit="req") as bar:
            while engine.has_unfinished():
                for delta in engine.step():
                    yield delta
                    bar.update(int(delta.finished))

    def _run(self, texts: list[str | None], ids: list[list[int]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        decode = self.get_tokenizer().decode
        requests = self._requests(ids, params)
        results = {req.request_id: RequestOutput(
            req.request_id, text, req.prompt_token_ids,
            [CompletionOutput(c, "", [], [] if req.params.logprobs is not None else None, None)
             for c in range(req.params.n)], False) for req, text in zip(requests, texts)}
        for delta in self._step_all(requests, "generate", use_tqdm):
            final = results[delta.request_id]
            if delta.prompt_logprobs is not None:
                final.prompt_logprobs = [None] + [logprob_dict(r, decode) for r in delta.prompt_logprobs]
            for c in delta.outputs:
                acc = final.outputs[c.index]
                acc.text += c.text
                acc.token_ids += c.token_ids
                if acc.logprobs is not None:
                    acc.logprobs += [logprob_dict(r, decode) for r in c.logprobs[:len(c.token_ids)]]
                acc.finish_reason = c.finish_reason or acc.finish_reason
            final.finished = final.finished or delta.finished
            final.num_cached_tokens = delta.num_cached_tokens
        return [results[req.request_id] for req in requests]


def logprob_dict(r: "SampleResult", decode) -> dict[int, Logprob]:
    """vLLM's shape: the (sampled or prompt) token first, then the top-N, most likely first.
    `decode`: the tokenizer's."""
    ranks = {t: i + 1 for i, (t, _) in enumerate(r.top)}
    rank = r.rank if r.rank is not None else ranks.get(r.token)
    out = {r.token: Logprob(r.logprob, rank, decode([r.token], skip_special_tokens=False))}
    for t, lp in r.top:
        out.setdefault(t, Logprob(lp, ranks[t], decode([t], skip_special_tokens=False)))
    return out
