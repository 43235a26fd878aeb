"""The `jaxserve` command: serve | generate | convert | run-batch | check.

Each subcommand is an `_add_<name>(subparsers)` function that declares its arguments and sets
`func`; a new subcommand is one more such function listed in SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import sys

import yaml

from jaxserve import check_cli
from jaxserve.config import (KV_CACHE_DTYPES, QUANTIZATION_MODES, QUANTIZE_LM_HEAD_HELP, RUNNERS, DistributedConfig,
                             EngineConfig, read_hf_config)
from jaxserve.server.reasoning import PARSERS as REASONING_PARSERS
from jaxserve.server.tool_parsers import PARSERS

# configs/tiny-cpu.yaml of a source checkout (`pip install -e .`): the default for the embedded model.
TINY_CPU_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "configs", "tiny-cpu.yaml")


def engine_config(args) -> EngineConfig:
    """--config YAML (with --model, --tp/--sp/--dp, --enable-expert-parallel, --quantization, --quantize-lm-head,
    --kv-cache-dtype, --decode-steps, --step-shapes, --generation-config, --runner and the LoRA flags on top); with neither,
    configs/tiny-cpu.yaml when present."""
    path = args.config or (TINY_CPU_CONFIG if args.model is None and os.path.exists(TINY_CPU_CONFIG) else None)
    cfg = EngineConfig.from_yaml(path, model=args.model) if path else EngineConfig(model=args.model)
    axes = {"model": args.tp, "seq": args.sp, "data": args.dp}
    cfg = dataclasses.replace(cfg, mesh={**cfg.mesh, **{axis: n for axis, n in axes.items() if n is not None}})
    if args.speculative_config:
        cfg = dataclasses.replace(cfg, speculative=json.loads(args.speculative_config))
    if args.hf_overrides:
        cfg = dataclasses.replace(cfg, hf_overrides=json.loads(args.hf_overrides))
    flags = {"quantization": args.quantization, "quantize_lm_head": args.quantize_lm_head or None,
             "kv_cache_dtype": args.kv_cache_dtype, "decode_steps": args.decode_steps, "step_shapes": args.step_shapes,
             "generation_config": args.generation_config, "runner": args.runner,
             "allow_weight_updates": args.allow_weight_updates or None,
             "enable_sleep_mode": args.enable_sleep_mode or None,
             "enable_expert_parallel": args.enable_expert_parallel or None}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in flags.items() if v is not None})
    modules = args.lora_modules and {**cfg.lora_modules, **dict(map(_lora_module, args.lora_modules))}
    # vLLM's switch for the same routes too, so its deployment scripts work unchanged
    runtime = args.allow_runtime_lora_updating or os.environ.get(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
    lora = {"enable_lora": args.enable_lora or None, "lora_modules": modules, "max_loras": args.max_loras,
            "max_lora_rank": args.max_lora_rank, "allow_runtime_lora_updating": runtime or None}
    return dataclasses.replace(cfg, **{k: v for k, v in lora.items() if v is not None})


def _lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' NAME=PATH."""
    name, sep, path = text.partition("=")
    if not (sep and name and path):
        raise SystemExit(f"--lora-modules takes NAME=PATH (a PEFT adapter directory), got {text!r}")
    return name, path


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory or orbax checkpoint "
                                   "(default: the embedded tiny model)")
    p.add_argument("--config", help="engine config YAML (EngineConfig keys), e.g. configs/tiny-cpu.yaml "
                                    "(default: configs/tiny-cpu.yaml for the embedded model)")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (mesh 'model' axis; overrides the config)")
    p.add_argument("--sp", type=int, help="sequence-parallel degree (mesh 'seq' axis)")
    p.add_argument("--dp", type=int, help="data-parallel replicas (mesh 'data' axis; `serve` only)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixtures of experts: split the experts whole over the 'model' axis (each chip holds "
                        "num_experts / tp of them), not each expert's width; attention and dense layers stay "
                        "tensor-parallel (vLLM's)")
    p.add_argument("--quantization", choices=QUANTIZATION_MODES,
                   help="quantize the Linear weights at load time: int8 / int4 / int4_asym (zero points) / fp8 (e4m3, a scale per 128 inputs) weight-only, or w8a8 (int8 weights and per-token int8 activations); overrides the config")
    p.add_argument("--quantize-lm-head", action="store_true", help=QUANTIZE_LM_HEAD_HELP)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model dtype), int8 or fp8 (e4m3) with per-token scales")
    p.add_argument("--decode-steps", type=int, help="decode steps one device program runs while every "
                   "sequence decodes (multi-step decoding; 1: one a program)")
    p.add_argument("--step-shapes", choices=["all", "largest"], help="all (default): a step program per "
                   "batch bucket, all compiled at warm-up; largest: only the largest decode and prefill shapes, "
                   "every batch padded into them (a faster start-up, more padding)")
    p.add_argument("--generation-config", choices=["auto", "none"],
                   help="auto (default): the model's generation_config.json sampling settings (temperature, top_p, "
                        "top_k, min_p, repetition_penalty) are the defaults of requests that leave them out, as "
                        "in vLLM; none: OpenAI's defaults")
    p.add_argument("--runner", choices=RUNNERS, help="what the engine serves, as vLLM's: generate (text), pooling "
                   "(embeddings, classes, scores: /v1/embeddings, /classify, /score, /rerank), auto (default: "
                   "pooling for a sentence-transformers model, a base model or a sequence classifier)")
    p.add_argument("--hf-overrides", help="keys over the model's config.json as JSON (vLLM's), e.g. a Qwen3-Reranker "
                   "as a cross-encoder: '{\"architectures\": [\"Qwen3ForSequenceClassification\"], "
                   "\"classifier_from_token\": [\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}'")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="PEFT LoRA adapters to serve beside the model, loaded at start; a request's 'model' "
                        "naming one runs on it")
    p.add_argument("--max-loras", type=int, help="LoRA adapters resident on the device at once; requests of "
                                                 "others wait (default: as many as --lora-modules, at least 1)")
    p.add_argument("--max-lora-rank", type=int, help="the largest adapter rank (default 16); smaller ranks "
                                                     "are padded to it, so it sets LoRA's cost")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM with "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (also honoured)")
    p.add_argument("--allow-weight-updates", action="store_true",
                   help="serve: POST /update_weights_from_disk {\"model_path\": DIR} loads new weights of the "
                        "served model between requests, without recompiling (as sglang's)")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="serve: POST /sleep?level=1|2, POST /wake_up[?tags=weights|kv_cache], GET /is_sleeping "
                        "(vLLM's): the accelerator memory given back between an RL trainer's rollouts")
    p.add_argument("--speculative-config", help='speculative decoding as JSON (the engine config key '
                                                '`speculative`), e.g. \'{"method": "ngram", "num_tokens": 4}\' or '
                                                '\'{"method": "draft", "model": DIR, "num_tokens": 4}\'')


def _add_app_args(p: argparse.ArgumentParser) -> None:
    """What the routes need besides the engine (serve and run-batch): the model's name, its
    tool-call and reasoning parsers."""
    p.add_argument("--served-model-name", help="the name clients use in 'model' (default: the model "
                                               "directory's name, 'jaxserve-tiny' for the embedded model)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto' on chat: the calls the model writes are read by --tool-call-parser")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS),
                   help="the model's tool-call syntax: hermes (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.1/3.2), "
                        "mistral (Mistral 7B v0.3, Nemo, Small, Large), openai (gpt-oss), "
                        "pythonic (Llama 3.2 and 4, Gemma 3)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                   help="chat answers' reasoning as message.reasoning_content: deepseek_r1 (thinking begun in the "
                        "prompt: DeepSeek-R1, QwQ, Qwen3 thinking-2507), qwen3 (Qwen3's <think> blocks), "
                        "openai_gptoss (gpt-oss's analysis channel)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:ID' unless a request says otherwise (its "
                        "return_tokens_as_token_ids): a piece of a character has no text of its own")


def _app_options(args, cfg: EngineConfig) -> dict:
    """create_app's keywords from _add_app_args' flags; ValueError if they do not go together.
    Unless a reasoning parser is named, a family's own (registry.Architecture: gpt-oss's harmony
    messages) is used, and the `openai` tool parser's text is read as harmony too: the answer is
    then read out of them, never returned raw, as vLLM always reads gpt-oss's."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call syntax)")
    reasoning = args.reasoning_parser or _family_reasoning_parser(cfg)
    if reasoning is None and args.tool_call_parser == "openai":
        reasoning = "openai_gptoss"
    return dict(served_model_name=args.served_model_name, reasoning_parser=reasoning,
                tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids)


def _family_reasoning_parser(cfg: EngineConfig) -> str | None:
    """The served model's family's reasoning parser (None: none, the embedded model, or a directory
    without a config.json naming an architecture jaxserve serves)."""
    from jaxserve.models import registry   # here: it imports every family (flax), which --help needs not

    try:
        names = [] if cfg.model is None else read_hf_config(cfg.model, cfg.hf_overrides).get("architectures") or []
        return registry.architecture(names[0]).reasoning_parser if names else None
    except (FileNotFoundError, ValueError):
        return None


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $JAXSERVE_API_KEY; none: open)")
    p.add_argument("--api-keys-file", help="YAML or JSON mapping API key -> tenant: each key is accepted, and "
                                           "tenants never share prefix-cache pages")
    _add_app_args(p)
    p.add_argument("--request-timeout", type=float, help="seconds a request may wait and run before it ends "
                                                         "with a 408 error (default: the config's request_timeout_s)")
    multi = p.add_argument_group("multi-host", "one process per host, one mesh over all their devices: "
                                 "run the same command on every host; process 0 serves HTTP, the others "
                                 "follow its steps")
    multi.add_argument("--coordinator-address", help="host:port of process 0 "
                                                     "(default: $JAXSERVE_COORDINATOR_ADDRESS)")
    multi.add_argument("--num-processes", type=int, help="default: $JAXSERVE_NUM_PROCESSES")
    multi.add_argument("--process-id", type=int, help="default: $JAXSERVE_PROCESS_ID")
    multi.add_argument("--multihost", action="store_true",
                       help="multi-host with whatever is not given detected by JAX (Cloud TPU pod slice, "
                            "SLURM, Open MPI)")
    p.set_defaults(func=serve)


def _distributed(args) -> DistributedConfig | None:
    """This process's multi-host settings (flags, else JAXSERVE_* variables, else cluster
    detection); None on one host. JAX is imported only when multi-host is asked for."""
    given = [getattr(args, name) for name in DistributedConfig.ENV]
    if not (args.multihost or any(v is not None for v in given)
            or any(os.environ.get(env) for env in DistributedConfig.ENV.values())):
        return None
    from jaxserve import multihost

    return multihost.distributed_config(*given)


def _follow(cfg: EngineConfig) -> int:
    """A multi-host process other than 0: the same engine and warm-up as process 0's, then its steps."""
    from jaxserve import factory

    follower = factory.build_client(cfg).start()
    log = logging.getLogger("jaxserve.follower")
    log.info("process %d of %d: following process 0", cfg.distributed.process_id, cfg.distributed.num_processes)
    follower.shutdown(drain=True)   # returns when process 0 stops serving
    log.info("process 0 stopped serving after %d steps", follower.steps)
    logging.shutdown()
    os._exit(0)   # as process 0's worker does: no teardown, no jax.distributed shutdown barrier


def serve(args) -> int:
    from jaxserve.server.app import read_api_keys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = dataclasses.replace(engine_config(args), distributed=_distributed(args))
        if args.request_timeout is not None:
            cfg = dataclasses.replace(cfg, request_timeout_s=args.request_timeout)
        api_keys = None if args.api_keys_file is None else read_api_keys(args.api_keys_file)
        options = _app_options(args, cfg)
    except (ValueError, OSError, yaml.YAMLError) as e:
        sys.exit(f"jaxserve serve: {e}")
    if cfg.distributed is not None and not cfg.distributed.is_leader:
        return _follow(cfg)
    from jaxserve.server.http_server import HTTPServer, exit_on_load_error

    def app_factory():
        from jaxserve.server.app import create_app
        return create_app(cfg, api_key=args.api_key, on_load_error=exit_on_load_error, api_keys=api_keys, **options)

    # A thread per request being served: every running and queued request, plus a few for probes.
    threads = cfg.max_num_seqs + cfg.max_queue_size + 8
    HTTPServer(app_factory, args.host, args.port, threads).run()
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="print a continuation of a prompt (offline, no server)")
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int)
    p.set_defaults(func=generate)


def generate(args) -> int:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        cfg = engine_config(args)
    except ValueError as e:
        sys.exit(f"jaxserve generate: {e}")
    llm = LLM(**dataclasses.asdict(cfg))
    out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def _add_convert(sub) -> None:
    p = sub.add_parser("convert", help="write an orbax-checkpoint copy of a Hugging Face model directory")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--quantization", choices=QUANTIZATION_MODES,
                   help="save the Linear weights quantized (embeddings and LM head as --dtype)")
    p.add_argument("--quantize-lm-head", action="store_true", help=QUANTIZE_LM_HEAD_HELP)
    p.set_defaults(func=convert)


def convert(args) -> int:
    import jax.numpy as jnp

    from jaxserve.checkpoint import convert_to_orbax

    print(convert_to_orbax(args.src, args.dst, dtype=getattr(jnp, args.dtype), quantization=args.quantization,
                           lm_head=args.quantize_lm_head))
    return 0


def _add_run_batch(sub) -> None:
    p = sub.add_parser("run-batch", help="answer a file of OpenAI Batch API requests (JSONL), as vLLM's run-batch")
    _add_model_args(p)
    _add_app_args(p)
    p.add_argument("-i", "--input-file", required=True, help="JSONL: one {custom_id, method, url, body} a line")
    p.add_argument("-o", "--output-file", required=True, help="JSONL: one {id, custom_id, response, error} a line, "
                                                              "in input order")
    p.set_defaults(func=run_batch)


def run_batch(args) -> int:
    from jaxserve import run_batch as batch
    from jaxserve.server.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = engine_config(args)
        options = _app_options(args, cfg)
    except ValueError as e:
        sys.exit(f"jaxserve run-batch: {e}")
    app, code = create_app(cfg, **options), 0
    try:
        # As many at once as the engine runs and queues: every sequence busy, no 429.
        batch.run(app, args.input_file, args.output_file, cfg.max_num_seqs + cfg.max_queue_size)
    except (RuntimeError, OSError) as e:
        print(f"jaxserve run-batch: {e}", file=sys.stderr)
        code = 1
    app.extensions["jaxserve"].shutdown()
    # As serve: no interpreter teardown (the XLA client's, with warm-up perhaps still compiling
    # on its thread, can abort the process); the output file is closed.
    logging.shutdown()
    os._exit(code)


SUBCOMMANDS = [_add_serve, _add_generate, _add_convert, _add_run_batch, check_cli.add_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


# Device nodes of the accelerators JAX serves on: TPU (v4/v5e accel, v5p/v6e vfio), NVIDIA, AMD.
ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def use_cpu_without_accelerator() -> None:
    """On a machine with no accelerator, JAX would still start every installed plugin (the TPU
    and CUDA compilers `make test` installs for the compile checks) and print pages of errors
    and a traceback before falling back to the CPU: go to the CPU directly, unless JAX_PLATFORMS
    says otherwise (what remains: the CUDA plugin's one-line notes as jax is imported). Compile-only devices (`jaxserve check`) need no backend and still work."""
    if "JAX_PLATFORMS" not in os.environ and not any(glob.glob(p) for p in ACCELERATOR_NODES):
        import jax
        jax.config.update("jax_platforms", "cpu")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    use_cpu_without_accelerator()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
