"""Position extrapolation: RoPE against ALiBi past the training context.

Two tiny decoders of the same size are trained from the same seed on the same text, the same
batches and the same number of steps, at a context of 128 tokens: a Llama (RoPE) and an MPT
(ALiBi), both the jaxserve Flax modules that serve (models/llama.py, models/layernorm_decoder.py) through
their full-sequence path (`forward_logits`, attention without a KV cache). Both are then scored
on held-out text in windows of 128, 256, 512 and 1024 tokens: the same held-out tokens at every
length, each window scored over all its tokens (so a longer window gives its later tokens more
context: a model that extrapolates gets better, one that does not gets worse).

Text: the docstrings of the Python standard library (modules, classes, functions), read from
the sources with `ast` (nothing imported, no network), one document per module; every 10th
module (sorted by name) is held out. Tokens: the embedded tiny model's tokenizer (4096 pieces).

What else differs between the two families, as they are: Llama has RMSNorm and a SwiGLU MLP,
MPT LayerNorm (no biases) and a GELU MLP; the Llama MLP width is chosen so that both have the
same parameter count (within 1%).

    JAX_PLATFORMS=cpu python -m benchmarks.position_extrapolation [--steps 800] [--out benchmarks/results/position_extrapolation]
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import (RESULTS_DIR, command_line, load_average, markdown_table, pyplot, report_header,
                               save_figure, write_keeping_notes, write_text)
from jaxserve.config import ModelConfig
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.models import build_model, init_params
from jaxserve.tokenizer import load_tokenizer

CONTEXTS = (128, 256, 512, 1024)
SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages"}
MACHINE = "2-core CPU dev box"


def family_configs(hidden: int, layers: int, heads: int, vocab_size: int, context: int) -> dict[str, dict]:
    """HF config.json dicts of the two models. MPT's GELU MLP has 2 * hidden * 4 hidden weights;
    Llama's gated MLP 3 * hidden * width, so width = 8 hidden / 3 gives the same count."""
    common = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    return {
        "RoPE (Llama)": dict(common, architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden,
                             intermediate_size=8 * hidden // 3, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=heads, max_position_embeddings=context, rope_theta=10000.0),
        "ALiBi (MPT)": dict(common, architectures=["MptForCausalLM"], model_type="mpt", d_model=hidden,
                            n_heads=heads, n_layers=layers, expansion_ratio=4, max_seq_len=context, no_bias=True,
                            attn_config={"alibi": True, "alibi_bias_max": 8}),
    }


# ---------------------------------------------------------------------------- text

def stdlib_docstrings(stdlib: str | None = None) -> dict[str, str]:
    """Module name -> its docstrings (module, classes, functions, in source order), for every
    module of the standard library with any (tests, GUI and vendored packages left out)."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    docs = {}
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            try:
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue   # a few files are deliberately broken or not UTF-8
            nodes = (n for n in ast.walk(tree)
                     if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
            text = "\n\n".join(d for d in map(ast.get_docstring, nodes) if d)
            if text:
                docs[os.path.relpath(path, stdlib)[:-3].replace(os.sep, ".")] = text
    return docs


def split_by_module(docs: dict[str, str], every: int = 10) -> tuple[dict[str, str], dict[str, str]]:
    names = sorted(docs)
    held = {n for i, n in enumerate(names) if i % every == every // 2}
    return ({n: docs[n] for n in names if n not in held}, {n: docs[n] for n in names if n in held})


def token_stream(tokenizer, docs: dict[str, str]) -> np.ndarray:
    """All documents as one id stream, each `<s> doc </s>`."""
    ids = []
    for text in docs.values():
        ids += [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_ids[0]]
    return np.asarray(ids, np.int32)


# ---------------------------------------------------------------------------- train and score

def token_losses_fn(model):
    """(params, tokens [B, T + 1]) -> next-token cross entropy [B, T], through forward_logits."""
    def token_losses(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        logits = model.apply({"params": params}, inputs, positions, method=model.forward_logits)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return token_losses


def train(cfg: ModelConfig, train_ids: np.ndarray, args, log) -> tuple[dict, dict]:
    """AdamW from seed args.seed; the batches depend on the seed only (the same for both models)."""
    token_losses = token_losses_fn(build_model(cfg))
    params = init_params(cfg, jax.random.key(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(50, args.steps // 10 + 1), args.steps,
                                                  end_value=args.lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: token_losses(p, tokens).mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(args.seed)
    start, curve, recent = time.time(), [], []
    for i in range(1, args.steps + 1):
        starts = rng.integers(0, len(train_ids) - args.context - 1, size=args.batch_size)
        batch = np.stack([train_ids[s:s + args.context + 1] for s in starts])
        params, opt_state, loss = step(params, opt_state, batch)
        recent.append(loss)
        if i % args.log_every == 0 or i == args.steps:
            curve.append((i, float(np.mean(jax.device_get(recent)))))
            recent = []
            log(f"  step {i}: train loss {curve[-1][1]:.3f}, {time.time() - start:.0f} s")
    stats = {"parameters": int(sum(x.size for x in jax.tree.leaves(params))), "steps": args.steps,
             "train_seconds": round(time.time() - start, 1), "loss_curve": curve}
    return params, stats


def heldout_losses(cfg: ModelConfig, params, stream: np.ndarray, context: int, batch_tokens: int) -> np.ndarray:
    """Per-token losses [windows, context] of non-overlapping windows of `context` tokens (+ 1 target)."""
    token_losses = jax.jit(token_losses_fn(build_model(cfg)))
    n = (len(stream) - 1) // context
    windows = np.stack([stream[i * context:(i + 1) * context + 1] for i in range(n)])
    rows = max(1, batch_tokens // context)
    out = []
    for i in range(0, n, rows):
        chunk = windows[i:i + rows]
        padded = np.concatenate([chunk, np.repeat(chunk[-1:], rows - len(chunk), axis=0)])   # one compile
        out.append(np.asarray(token_losses(params, padded))[:len(chunk)])
    return np.concatenate(out)


def evaluate(cfg: ModelConfig, params, stream: np.ndarray, args) -> dict:
    """Perplexity at each context over the same tokens, and the mean loss by position (32-token
    bins) in the longest windows."""
    result = {"perplexity": {}}
    for context in CONTEXTS:
        losses = heldout_losses(cfg, params, stream, context, args.batch_tokens)
        result["perplexity"][str(context)] = float(np.exp(losses.mean()))
    bins = losses.reshape(len(losses), -1, 32).mean(axis=(0, 2))   # losses of the longest context
    result["loss_by_position"] = [float(x) for x in bins]
    return result


# ---------------------------------------------------------------------------- report

def markdown(report: dict) -> str:
    models = report["models"]
    header = ["model", "parameters", *(f"ppl @ {c}" for c in CONTEXTS), f"{CONTEXTS[-1]} / {CONTEXTS[0]}"]
    rows = []
    for name, m in models.items():
        ppl = m["eval"]["perplexity"]
        rows.append([name, f"{m['parameters']:,}", *(f"{ppl[str(c)]:.2f}" for c in CONTEXTS),
                     f"{ppl[str(CONTEXTS[-1])] / ppl[str(CONTEXTS[0])]:.2f}x"])
    train_rows = [[name, m["steps"], f"{m['loss_curve'][-1][1]:.3f}", f"{m['train_seconds']:.0f}"]
                  for name, m in models.items()]
    c = report["corpus"]
    return "\n".join([
        "# Position extrapolation: RoPE against ALiBi", "",
        f"Command: `{report['command']}`  ",
        f"Machine: {MACHINE} ({report['machine']['cpu']}; shared: load average "
        f"{report['load_average'][0]:.1f} at start, {report['load_average'][1]:.1f} at the end), "
        f"jax {report['machine']['jax']}, {report['date']}", "",
        f"Text: docstrings of the Python {c['python']} standard library, one document per module; "
        f"{c['train_modules']} modules for training ({c['train_tokens']:,} tokens), {c['heldout_modules']} "
        f"held out (every 10th by name; {c['heldout_tokens']:,} tokens scored at every context). "
        "Tokenizer: the embedded tiny model's (4096 pieces).  ",
        f"Models: hidden {report['args']['hidden']}, {report['args']['layers']} layers, "
        f"{report['args']['heads']} heads, tied embeddings, float32, seed {report['args']['seed']}; "
        f"trained at context {report['args']['context']}, batch {report['args']['batch_size']}, "
        f"AdamW peak lr {report['args']['lr']} (warmup, cosine to 10%), the same batches for both. "
        "Training and scoring run the jaxserve Flax modules that serve (`forward_logits`, attention "
        "without a KV cache: `attention.attend` -> the jnp causal attention, ALiBi slopes from "
        "`mpt_slopes`).", "",
        "## Held-out perplexity by context length", "",
        *markdown_table(header, rows, right_aligned=tuple(range(1, len(header)))), "",
        "## Training", "",
        *markdown_table(["model", "steps", "final train loss (last log interval)", "seconds"], train_rows,
                        right_aligned=(1, 2, 3)), "",
        "![held-out perplexity by context and loss by position](position_extrapolation.png)", "",
    ]) + "\n"


def plot(report: dict, path: str) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, m in report["models"].items():
        ppl = m["eval"]["perplexity"]
        left.plot(CONTEXTS, [ppl[str(c)] for c in CONTEXTS], marker="o", label=name)
        by_pos = m["eval"]["loss_by_position"]
        right.plot([32 * i + 16 for i in range(len(by_pos))], by_pos, marker=".", label=name)
    for ax in (left, right):
        ax.axvline(report["args"]["context"], color="gray", linestyle="--", linewidth=1)
        ax.legend()
    left.set_xscale("log", base=2)
    left.set_xticks(CONTEXTS, [str(c) for c in CONTEXTS])
    left.set(xlabel="evaluation window (tokens)", ylabel="held-out perplexity",
             title="Trained at 128 tokens (dashed line)")
    right.set(xlabel=f"position in a {CONTEXTS[-1]}-token window", ylabel="mean held-out loss (nats)",
              title="Loss by position (32-token bins)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=128, help="training context")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--heldout-tokens", type=int, default=32 * 1024, help="held-out tokens scored (at most)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per scoring batch")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "position_extrapolation"))
    args = p.parse_args(argv)
    load_start = load_average()
    tokenizer = load_tokenizer(TINY_MODEL_DIR)
    train_docs, heldout_docs = split_by_module(stdlib_docstrings())
    train_ids = token_stream(tokenizer, train_docs)
    heldout = token_stream(tokenizer, heldout_docs)
    longest = CONTEXTS[-1]
    heldout = heldout[:min(len(heldout) - 1, args.heldout_tokens) // longest * longest + 1]   # whole windows
    print(f"{len(train_docs)} training modules ({len(train_ids):,} tokens), {len(heldout_docs)} held out "
          f"({len(heldout) - 1:,} tokens scored)", flush=True)
    report = report_header(command_line("position_extrapolation", argv), args)
    report["corpus"] = {"python": platform.python_version(), "train_modules": len(train_docs),
                        "train_tokens": len(train_ids), "heldout_modules": len(heldout_docs),
                        "heldout_tokens": len(heldout) - 1, "heldout": sorted(heldout_docs)}
    report["models"] = {}
    for name, hf in family_configs(args.hidden, args.layers, args.heads, tokenizer.vocab_size, args.context).items():
        cfg = ModelConfig.from_hf_dict(hf)
        print(f"{name}: training", flush=True)
        params, stats = train(cfg, train_ids, args, print)
        stats["eval"] = evaluate(cfg, params, heldout, args)
        print(f"{name}: {stats['parameters']:,} parameters, held-out perplexity {stats['eval']['perplexity']}",
              flush=True)
        report["models"][name] = stats
    report["load_average"] = [load_start, load_average()]
    write_text(args.out + ".json", json.dumps(report, indent=1))
    plot(report, args.out + ".png")
    write_keeping_notes(args.out + ".md", markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
