"""Configuration: the model (read from a Hugging Face config.json) and the engine (sampling: sampling_params.py)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import TYPE_CHECKING, Any, ClassVar

import yaml

from jaxserve.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:   # the families' own option types (their modules import this one)
    from jaxserve.models.mla import LatentDims
    from jaxserve.models.routing import Routing


QUANTIZATION_MODES = ("int8", "int4", "int4_asym", "fp8", "w8a8")   # weight-only, int4_asym with zero points; w8a8 int8 x int8 (jaxserve/quantization.py)
QUANTIZE_LM_HEAD_HELP = ("quantize the LM head too, as --quantization says (a tied head: a quantized copy of "
                         "the embedding table; lookups keep the table)")   # the CLI flags' help
RUNNERS = ("auto", "generate", "pooling")   # what an engine serves (jaxserve/pooling.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")   # KV cache storage (jaxserve/kv_cache.py)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding settings besides the base (models/layers.py rope_from_hf reads them from
    config.json as transformers does; rope_frequencies turns them into frequencies). `kind` is one
    of models.layers.ROPE_KINDS; each kind reads only its own fields."""
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0                  # llama3
    high_freq_factor: float = 4.0                 # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope: the pretraining length
    beta_fast: float = 32.0                       # yarn: the ramp between interpolated and kept frequencies
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()          # longrope: per-frequency divisors, within and
    long_factor: tuple[float, ...] = ()           # beyond the pretraining length
    attention_factor: float = 1.0                 # yarn, longrope: cos and sin are scaled by it
    rotary_fraction: float = 1.0                  # the share of each head that rotates (its first dims)
    # The longest sequence the engine serves (its max_model_len; 0: the model's
    # max_position_embeddings). longrope and dynamic choose their frequencies by it once, for every
    # token: KV written early stays valid, and no batch changes another's positions (as vLLM).
    context_length: int = 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rope_interleaved: bool = False   # RoPE rotates adjacent pairs of dims (GPT-J, GLM), not the two halves
    nope_layers: tuple[int, ...] = ()   # layers whose attention has no RoPE ("NoPE": SmolLM3, EXAONE 4)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False         # RMSNorm over each head of q and of k, before RoPE (Qwen3)
    qk_norm_per_head: bool = True  # False: qk_norm over the whole q and k projections, all heads together (OLMo 2)
    qk_layernorm: bool = False    # LayerNorm over each head of q and of k, a weight for each head (Command R+, StableLM 2)
    hidden_act: str = "silu"      # the gated MLP's activation (models.layers.ACTIVATIONS)
    # Gemma: norms scale by (offset + weight), embeddings by sqrt(hidden_size), norms also after
    # attention and after the MLP ("sandwich"), an attention scale other than 1/sqrt(head_dim),
    # tanh soft caps of attention scores and final logits. Granite: embeddings, each branch's
    # output (before its residual add) and the logits (divided) scaled by their own constants.
    norm_offset: float = 0.0
    norm_scale_f32: bool = False   # norms scale in float32, cast once (gpt-oss, OLMo 2): layers.RMSNorm
    embedding_multiplier: float = 1.0   # applied in the model's dtype, as HF does
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    sandwich_norms: bool = False
    pre_norms: bool = True   # False: no norms before attention and the MLP, only sandwich_norms' after (OLMo 2)
    attn_scale: float | None = None
    attn_soft_cap: float | None = None
    attn_sinks: bool = False   # gpt-oss: a learned logit per query head joins each softmax (weight, no output)
    final_soft_cap: float | None = None
    local_rope_theta: float | None = None   # Gemma 3: windowed layers' RoPE base (unscaled); None: as global
    # The LayerNorm families (models/layernorm_decoder.py): BLOOM and MPT's ALiBi instead of RoPE,
    # one slope per query head (the family's own formula); LayerNorms (rms_norm_eps is their
    # epsilon), with biases or not; a LayerNorm after the embedding (BLOOM); one q/k/v projection
    # interleaved per head [q, k, v] (BLOOM, GPT-NeoX); q, k and v clamped to [-clip_qkv, clip_qkv]
    # (MPT); attention and MLP both reading the block's input (GPT-NeoX, Phi), through one
    # LayerNorm (Phi); a bias on the LM head (Phi); a learned position embedding added to the
    # token's, max_position_embeddings of them (GPT-2, GPTBigCode), in place of RoPE.
    alibi_slopes: tuple[float, ...] | None = None
    norm_bias: bool = False
    embed_norm: bool = False
    qkv_interleaved: bool = False
    clip_qkv: float | None = None
    parallel_residual: bool = False
    shared_block_norm: bool = False
    lm_head_bias: bool = False
    learned_positions: bool = False
    gated_mlp: bool = False   # the LayerNorm families' MLP gated as Llama's (StableLM, Cohere)
    # Per-layer sliding window (None = full attention); a tuple so the config stays hashable.
    sliding_windows: tuple[int | None, ...] = ()
    # Mixture of experts (models/moe.py): the layers whose MLP is `num_experts` SwiGLU experts of width
    # moe_intermediate_size, `num_experts_per_tok` a token (the other layers: the dense intermediate_size MLP);
    # norm_topk_prob: the top-k weights divided by their sum; num_experts 0: a dense model. gpt-oss: a biased
    # router and experts (moe_bias), the softmax over the top k logits alone (moe_softmax_topk), with swiglu_limit
    # layers.clamped_swiglu's product. DeepSeek: latent attention (models/mla.py), its routing (routing.py), shared
    # experts' width (GLM-4.5's too); Qwen2-MoE's one is gated: its output times sigmoid(shared_expert_gate(x)).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    moe_bias: bool = False
    moe_softmax_topk: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    mla: LatentDims | None = None
    moe_routing: Routing | None = None
    moe_shared_intermediate_size: int = 0
    moe_shared_gate: bool = False
    # Expert parallelism (the engine's enable_expert_parallel): the experts' stacks split on their expert
    # axis over "model", each device holding whole experts (jaxserve/parallel.py), not a share of every one.
    expert_parallel: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self):
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)

    @functools.cached_property   # traces the family's init: once per config, not per caller
    def num_params(self) -> int:
        """Exact, from the family's parameter shapes (traced abstractly: nothing is allocated)."""
        import jax  # importing jaxserve starts no JAX

        from jaxserve.checkpoint import param_shapes

        return sum(math.prod(s.shape) for s in jax.tree.leaves(param_shapes(self)))

    @property
    def num_active_params(self) -> int:
        """The parameters a token is multiplied by: all of them less, in each MoE layer, the
        gate, up and down weights (and biases) of the experts it is not routed to."""
        unused = self.num_experts - self.num_experts_per_tok
        width, hidden = self.moe_intermediate_size, self.hidden_size
        per_expert = 3 * hidden * width + (2 * width + hidden if self.moe_bias else 0)
        return self.num_params - len(self.moe_layers) * unused * per_expert

    @property
    def values_are_keys(self) -> bool:
        """Whether attention's values are its keys, so the KV cache holds K alone: latent
        attention's one KV head, [c_kv, k_rope], is both (models/mla.py)."""
        return self.mla is not None

    @property
    def kv_pools(self) -> int:
        """Page pools the KV cache holds a layer: K and V, or K alone when the values are the keys."""
        return 1 if self.values_are_keys else 2

    def serving(self, max_model_len: int) -> "ModelConfig":
        """This config as an engine serving sequences of up to max_model_len tokens runs it: the
        RoPE kinds that choose their frequencies by the context see that length. A learned
        position table has no row past its length: a longer max_model_len is refused."""
        if self.learned_positions and max_model_len > self.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {self.max_position_embeddings} "
                             "learned positions (max_position_embeddings)")
        return dataclasses.replace(self, rope_scaling=dataclasses.replace(self.rope_scaling, context_length=max_model_len))

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Parse a HF config.json dict with its architecture's parser (jaxserve.models.registry);
        an architecture without one fails here, listing the supported ones."""
        from jaxserve.models.registry import config_from_hf  # the families import this module

        return config_from_hf(cfg)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        return cls.from_hf_dict(read_hf_config(model_dir))


def read_hf_config(model_dir: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A model directory's config.json, `overrides` (vLLM's hf_overrides) over its keys."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json in {model_dir}")
    with open(path) as f:
        return {**json.load(f), **(overrides or {})}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """One process of a multi-host engine: the jax.distributed.initialize arguments."""
    # The documented variables a launcher may read them from (jaxserve.multihost.distributed_config).
    ENV: ClassVar[dict[str, str]] = {"coordinator_address": "JAXSERVE_COORDINATOR_ADDRESS",
                                     "num_processes": "JAXSERVE_NUM_PROCESSES",
                                     "process_id": "JAXSERVE_PROCESS_ID"}
    coordinator_address: str               # host:port of process 0
    num_processes: int
    process_id: int

    def __post_init__(self):
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


@dataclasses.dataclass
class EngineConfig:
    """Everything the engine needs besides the model weights. Loadable from YAML; checked when
    built (a bad value fails here, naming the key, not deep in the engine)."""
    model: str | None = None                # HF directory or orbax checkpoint; None = embedded tiny model
    dtype: str = "auto"                     # auto | float32 | bfloat16 (auto: bf16 on TPU/GPU, f32 on CPU)
    max_model_len: int | None = None        # default: model's max_position_embeddings
    page_size: int = 16
    num_pages: int | None = None            # None: sized from kv_memory_fraction (accelerators) or kv_cache_mb (CPU)
    kv_cache_mb: int = 256                  # CPU KV pool size when num_pages is None
    kv_memory_fraction: float = 0.85        # share of free accelerator memory given to KV pages
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill_chunk_size: int = 256
    max_prefill_seqs: int = 4               # sequences with more than one new token in one step
    # Decode steps one device program runs while nothing waits to prefill, each step's sampled
    # tokens the next one's inputs (scheduler.py, step.py): the host plans and collects once per
    # `decode_steps` tokens. 1: a program per token.
    decode_steps: int = 1
    enable_prefix_caching: bool = True
    hybrid_kv_cache: bool = True            # sliding-window layers keep only their window's pages (kv_groups.py)
    # The step shapes a batch may run in (buckets.py): all (each bucket its own program, compiled at
    # warm-up) | largest (the largest decode shape and the largest shape with prefill rows only,
    # of each decode width, every batch padded up into one of them: 2 step programs to build, 4
    # with speculative decoding; a faster start-up for more padding in every step).
    step_shapes: str = "all"
    admission_eagerness: float = 1.0        # 1.0 admit whenever budget allows; 0.0 only when no decode is running
    attention_backend: str = "auto"         # auto | pallas_tpu | pallas_gpu | xla
    max_queue_size: int = 256               # requests in flight beyond max_num_seqs; more get 429
    max_failed_steps: int = 3               # consecutive failed steps that mean a lost device: the server exits
    request_timeout_s: float | None = None  # the server's deadline per request (a request's `timeout` may lower it)
    compilation_cache_dir: str | None = "~/.cache/jaxserve/xla"   # warm-up's executables, stored (executables.py)
    seed: int = 0
    poison_freed_pages: bool = False        # tests: NaN into every freed or newly taken page (tests/test_kv_isolation.py)
    mesh: dict[str, int] = dataclasses.field(default_factory=lambda: {"data": 1, "model": 1, "seq": 1})
    enable_expert_parallel: bool = False    # MoE: whole experts per device over "model" (parallel.py), not a share of each
    # This process's place in a multi-host engine (None: one process); a dict becomes a DistributedConfig.
    distributed: DistributedConfig | None = None
    # Speculative decoding (None: off); a dict (YAML, `LLM(speculative={...})`) becomes a SpeculativeConfig.
    speculative: SpeculativeConfig | None = None
    # Quantization of the Linear weights at load time (jaxserve/quantization.py): None | int8 |
    # int4 | int4_asym | fp8 (weight-only; int4_asym with per-group zero points) | w8a8 (int8 weights and
    # per-token int8 activations). An orbax checkpoint written quantized (`jaxserve convert --quantization`) loads as it is.
    quantization: str | None = None
    # Quantize the LM head too, in the same mode (default: it stays in the model dtype). A head tied
    # to the embeddings gets its own quantized copy of the table; lookups still read the table.
    quantize_lm_head: bool = False
    # KV cache storage: auto (the model dtype) | int8 | fp8 (e4m3), with a scale per token and KV head
    # (jaxserve/kv_cache.py). Quantized caches hold about twice the pages (4x from float32).
    kv_cache_dtype: str = "auto"
    # Request defaults from the model (sampling_defaults): auto, its generation_config.json's
    # sampling settings where a request leaves a field out (vLLM's default); none, OpenAI's defaults.
    generation_config: str = "auto"
    # Multi-LoRA (jaxserve/lora.py), as vLLM's flags: PEFT adapters served beside the base model,
    # a request on one of them or none. lora_modules {name: directory} are known from the start
    # (implying enable_lora); others become known through LLM.generate's lora_request or, with
    # allow_runtime_lora_updating, the server's /v1/load_lora_adapter. A step runs at most max_loras
    # adapters, each in a device slot (default: as many as lora_modules, at least 1); requests of
    # others wait. Ranks up to max_lora_rank, smaller ones zero-padded to it (its cost is the padded rank's).
    enable_lora: bool = False
    lora_modules: dict[str, str] = dataclasses.field(default_factory=dict)
    max_loras: int | None = None
    max_lora_rank: int = 16
    allow_runtime_lora_updating: bool = False
    # The server's POST /update_weights_from_disk (sglang's): new weights of the served model from a
    # checkpoint directory, in place, between requests (jaxserve/weight_update.py). Off by default: it
    # reads any path the server can.
    allow_weight_updates: bool = False
    # The server's vLLM sleep mode routes: POST /sleep?level=1|2, POST /wake_up[?tags=...], GET /is_sleeping (sleep_mode.py:
    # memory given back between an RL trainer's rollouts). Off by default, as vLLM's: a client could stop the serving.
    enable_sleep_mode: bool = False
    # What it serves, as vLLM's `runner`: generate (text) | pooling (embeddings, classes and scores, jaxserve/pooling.py)
    # | auto (pooling for a sentence-transformers model directory, a base-model or a sequence-classifier architecture).
    runner: str = "auto"
    # vLLM's hf_overrides: keys over the model's config.json, e.g. a Qwen3-Reranker (a causal LM) served as a cross-encoder:
    # {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], ...} (pooling.py).
    hf_overrides: dict[str, Any] | None = None

    def __post_init__(self):
        if isinstance(self.distributed, dict):
            self.distributed = DistributedConfig(**self.distributed)
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(**self.speculative)
        positive = ("page_size", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size",
                    "max_prefill_seqs", "kv_cache_mb", "max_failed_steps", "decode_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"engine config: {name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_pages"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"engine config: {name} must be at least 1 or null, got {getattr(self, name)}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"engine config: request_timeout_s must be positive or null, got {self.request_timeout_s}")
        if self.max_queue_size < 0:
            raise ValueError(f"engine config: max_queue_size must be 0 or more, got {self.max_queue_size}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"engine config: kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
        if not 0.0 <= self.admission_eagerness <= 1.0:
            raise ValueError(f"engine config: admission_eagerness must be in [0, 1], got {self.admission_eagerness}")
        if self.quantization not in (None, *QUANTIZATION_MODES):
            raise ValueError(f"engine config: quantization must be one of {', '.join(QUANTIZATION_MODES)} "
                             f"or null, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"engine config: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"engine config: hf_overrides must be a mapping of config.json keys, got "
                             f"{self.hf_overrides!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"engine config: runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.generation_config not in ("auto", "none"):
            raise ValueError(f"engine config: generation_config must be auto or none, got {self.generation_config!r}")
        if self.step_shapes not in ("all", "largest"):
            raise ValueError(f"engine config: step_shapes must be all or largest, got {self.step_shapes!r}")
        if not isinstance(self.hybrid_kv_cache, bool):   # a YAML "off" string would read as on
            raise ValueError(f"engine config: hybrid_kv_cache must be true or false, got {self.hybrid_kv_cache!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"engine config: enable_expert_parallel must be true or false, got "
                             f"{self.enable_expert_parallel!r}")
        if self.decode_steps > 1 and self.speculative is not None:
            raise ValueError("engine config: decode_steps > 1 (multi-step decoding) and speculative decoding "
                             "do not combine; choose one")
        if self.distributed is not None and self.speculative is not None and self.speculative.method == "draft":
            raise ValueError("engine config: a draft model (speculative method draft) runs in one process, "
                             "not in a multi-host engine (its steps are not broadcast to the followers)")
        if self.lora_slots < 1 or self.max_lora_rank < 1:
            raise ValueError(f"engine config: max_loras and max_lora_rank must be at least 1; got {self.max_loras} "
                             f"and {self.max_lora_rank}")
        if self.distributed is not None and self.serves_lora and (
                len(self.lora_modules) > self.lora_slots or self.allow_runtime_lora_updating):
            raise ValueError("engine config: a multi-host engine loads LoRA adapters at start only (a later load "
                             "is not sent to the other processes): max_loras must hold every lora_modules adapter, "
                             "and allow_runtime_lora_updating is off")
        if self.distributed is not None and self.mesh.get("data", 1) > 1:
            raise ValueError("engine config: data-parallel replicas (mesh data > 1) run in one process; "
                             "a multi-host engine is one engine over all hosts' devices")

    @property
    def serves_lora(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def lora_slots(self) -> int:
        """Adapters resident on the device: max_loras, by default as many as lora_modules, at least 1."""
        return self.max_loras if self.max_loras is not None else max(len(self.lora_modules), 1)

    # Settings only the host reads: never part of a compiled program (the pool's size reaches the
    # programs as num_pages, the model's shapes as the ModelConfig and the weights, the LoRA
    # adapters' targets as their stacks: see ModelRunner's executables).
    HOST_ONLY = ("model", "kv_cache_mb", "kv_memory_fraction", "enable_prefix_caching", "admission_eagerness",
                 "max_queue_size", "max_failed_steps", "request_timeout_s", "compilation_cache_dir", "seed",
                 "poison_freed_pages", "generation_config", "lora_modules", "allow_runtime_lora_updating",
                 "allow_weight_updates", "enable_sleep_mode", "step_shapes")

    def program_settings(self) -> dict[str, Any]:
        """The settings that may decide a compiled program: what the executable store is keyed on,
        so that engines differing only in host settings share their executables."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in self.HOST_ONLY}

    @classmethod
    def from_yaml(cls, path: str, **overrides: Any) -> "EngineConfig":
        with open(path) as f:
            data = yaml.safe_load(f) or {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown engine config keys in {path}: {sorted(unknown)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)
