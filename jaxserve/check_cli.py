"""The `jaxserve check` subcommand's arguments (check.py does the work; it imports JAX, so only
when the subcommand runs: the other subcommands' processes stay free of it until they need it)."""
from __future__ import annotations

from jaxserve.config import QUANTIZATION_MODES, QUANTIZE_LM_HEAD_HELP


def add_parser(sub) -> None:
    p = sub.add_parser("check", help="compile every step for a TPU slice or H100s (no TPU, GPU or weights "
                                     "needed) and report whether it fits in HBM")
    p.add_argument("--config", required=True, help="engine config YAML, e.g. configs/llama3-8b-v5e-8.yaml")
    p.add_argument("--topology", required=True, help="TPU slice: v5e-N, v6e-N (N chips) or v5p-N (N cores); "
                                                       "GPUs: h100 or h100-N (N of one host)")
    p.add_argument("--model", help="directory holding the model's config.json (default: the config's model)")
    p.add_argument("--attention-backend", choices=["pallas_tpu", "pallas_gpu", "xla"],
                   help="default: the config's (auto: the platform's Pallas kernels)")
    p.add_argument("--quantization", choices=QUANTIZATION_MODES,
                   help="quantized weights (default: the config's, or how the checkpoint is stored)")
    p.add_argument("--quantize-lm-head", action="store_true", help=QUANTIZE_LM_HEAD_HELP)
    p.add_argument("--quick", action="store_true", help="only the largest and smallest decode steps, the "
                                                         "largest prefill step and the page copy (no sampler)")
    p.set_defaults(func=run)


def run(args) -> int:
    from jaxserve import check

    return check.run(args.config, args.topology, args.model, args.attention_backend, args.quick, args.quantization,
                     args.quantize_lm_head)
