"""Per-request sampling settings (SamplingParams, checked when built; a pooling request's:
PoolingParams), their limits, the request error the engine raises (InvalidRequest), the defaults a
model recommends (generation_config.json), and the offline API's choice of LoRA adapter (LoRARequest)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

from jaxserve.structured.spec import StructuredOutput

MAX_N = 16                             # choices per request
MAX_LOGPROBS = 20                      # top-N logprobs per sampled token (the runner's sampler returns 20)
MAX_LOGIT_BIAS = 300                   # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 64
MAX_BAD_WORDS = 64


class InvalidRequest(ValueError):
    """A request the engine cannot serve; `param` names the field at fault (a SamplingParams
    field, or "prompt")."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's: a LoRA adapter by its name, a unique int id, and its PEFT directory (jaxserve/lora.py)."""
    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (the OpenAI / vLLM set), checked when built: a SamplingParams
    that exists is valid (frozen, so it stays so). Like vLLM, `stop` may be one string and
    `top_k=-1` means off."""
    n: int = 1
    max_tokens: int | None = 16           # None: up to the context length (set per prompt: `resolve`)
    temperature: float = 1.0              # 0 = greedy
    top_k: int = 0                        # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None           # top-N logprobs per sampled token (0 = only the sampled one)
    priority: int = 0                     # 0 online, 1 batch (lower runs first)
    min_tokens: int = 0                   # tokens before eos, stop_token_ids or a stop string may end it
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)   # token id -> added to its logit
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True      # in the output text
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last N tokens (-1: max_model_len)
    cache_salt: str | None = None         # mixed into the prefix-cache keys: only equal salts share pages
    prompt_logprobs: int | None = None    # top-N logprobs per prompt token (0 = only the token's own)
    structured_output: StructuredOutput | None = None   # the output's grammar: a JSON schema, a regex, choices
    allowed_token_ids: tuple[int, ...] | None = None    # the only tokens it may sample (None: any)
    bad_words: tuple[str, ...] = ()       # words it may not write (their last token banned where it would end one)
    # The LoRA adapter it runs on, by a name the engine knows (jaxserve/lora.py: a lora_modules entry,
    # or set by LLM.generate's lora_request; the server's: the body's `model`); None: the base model.
    lora_name: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        checks = [
            ("n", 1 <= self.n <= MAX_N, f"must be between 1 and {MAX_N}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1 or (
                self.max_tokens == 0 and self.prompt_logprobs is not None),
             "must be at least 1 (0, scoring the prompt only, needs prompt_logprobs) or null"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_k", 0 <= self.top_k < 2**31, "must be 0 or -1 (off) or a positive count below 2**31"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "must be in (0, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must hold non-empty strings"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be between 0 and {MAX_LOGPROBS}"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be between 0 and {MAX_LOGPROBS}"),
            ("priority", self.priority in (0, 1), "must be 0 (online) or 1 (batch)"),
            ("min_tokens", 0 <= self.min_tokens <= (math.inf if self.max_tokens is None else self.max_tokens),
             "must be between 0 and max_tokens"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
                isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
             f"must map at most {MAX_LOGIT_BIAS} token ids to biases between -100 and 100"),
            ("allowed_token_ids", self.allowed_token_ids is None or (
                bool(self.allowed_token_ids) and all(isinstance(t, int) for t in self.allowed_token_ids)),
             "must hold at least one token id"),
            ("bad_words", len(self.bad_words) <= MAX_BAD_WORDS and all(isinstance(w, str) and w.strip()
                                                                        for w in self.bad_words),
             f"must hold at most {MAX_BAD_WORDS} words, none empty"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"must hold at most {MAX_STOP_TOKEN_IDS} token ids"),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens in (None, -1) or self.truncate_prompt_tokens >= 1,
             "must be at least 1, or -1 (the model's context length)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequest(f"{name} {why} (got {getattr(self, name)!r})", param=name)
        if self.structured_output is not None:
            error = self.structured_output.error()
            if error is not None:
                raise InvalidRequest(f"structured output: {error}", param="structured_output")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def resolve(self, token_ids: list[int], max_model_len: int) -> tuple[list[int], "SamplingParams"]:
        """The prompt the engine runs (`token_ids` cut to their last truncate_prompt_tokens, -1:
        max_model_len) and these params for it (max_tokens None: the rest of the context, as vLLM)."""
        k = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        ids = list(token_ids) if k is None else list(token_ids)[-k:]
        if self.max_tokens is not None:
            return ids, self
        return ids, dataclasses.replace(self, max_tokens=max(1, max_model_len - len(ids)))


POOLING_TASKS = ("embed", "classify")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """vLLM's: a pooling request's settings (jaxserve/pooling.py), in place of a SamplingParams."""
    dimensions: int | None = None          # keep the first N (Matryoshka models only), then normalize
    normalize: bool | None = None          # None: as the model does
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last N tokens (-1: max_model_len)
    task: str = "embed"                    # what the engine returns: "embed" (the pooled hidden state)
                                           # or "classify" (a sequence classifier's label logits)

    def __post_init__(self):
        if self.task not in POOLING_TASKS:
            raise InvalidRequest(f"task must be one of {', '.join(POOLING_TASKS)} (got {self.task!r})", param="task")
        if self.truncate_prompt_tokens not in (None, -1) and self.truncate_prompt_tokens < 1:
            raise InvalidRequest(f"truncate_prompt_tokens must be at least 1, or -1 (the model's context length) "
                                 f"(got {self.truncate_prompt_tokens!r})", param="truncate_prompt_tokens")


# The sampling settings a generation_config.json may recommend (vLLM reads the same ones).
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@functools.lru_cache(maxsize=8)
def sampling_defaults(model_dir: str, source: str = "auto") -> dict[str, Any]:
    """The SamplingParams fields a model's authors recommend (its generation_config.json, with
    `source` "auto"; none with "none"): the server's request defaults and LLM's
    get_default_sampling_params. Checked here, so a bad file fails at start-up, naming it."""
    path = os.path.join(model_dir, "generation_config.json")
    if source != "auto" or not os.path.exists(path):
        return {}
    with open(path) as f:
        gen = json.load(f)
    found = {k: gen[k] for k in GENERATION_CONFIG_FIELDS if gen.get(k) is not None}
    try:
        SamplingParams(**found)
    except InvalidRequest as e:
        raise ValueError(f"{path}: {e}") from None
    return found
