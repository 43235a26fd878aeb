"""Train the embedded tiny models (jaxserve/assets/tiny and its draft in tiny/draft) on CPU.

Corpus: the CPython documentation topics shipped with every Python (`pydoc_data.topics`);
every 20th topic (sorted by name) is held out for perplexity. Half of the training topics are
wrapped in the chat template (a user asks about the topic, the assistant answers with it), so
the chat path produces text about Python too. Everything is seeded; the result depends only
on the Python version (its docs) and the library versions.

    python scripts/train_tiny_model.py                                  # the full run
    python scripts/train_tiny_model.py --smoke --out /tmp/tiny           # a few seconds
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import sentencepiece as spm
import transformers
from pydoc_data import topics as pydoc_topics
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

from jaxserve.checkpoint import load_params, save_pretrained
from jaxserve.config import ModelConfig
from jaxserve.generate import greedy_generate
from jaxserve.models import build_model, init_params
from jaxserve.tokenizer import load_tokenizer

ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAIN = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
            num_attention_heads=8, num_key_value_heads=2)
DRAFT = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
SMOKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1)
SAMPLE_PROMPTS = [
    "The for statement is used to",
    "A function definition defines",
    "The import statement",
    "Exceptions can be raised",
    "The with statement",
]


def split_corpus(max_topics: int | None) -> tuple[dict[str, str], dict[str, str]]:
    names = sorted(pydoc_topics.topics)[:max_topics]
    held = {n for i, n in enumerate(names) if i % 20 == 10}
    train = {n: pydoc_topics.topics[n] for n in names if n not in held}
    return train, {n: pydoc_topics.topics[n] for n in names if n in held}


# ---------------------------------------------------------------------------- tokenizer

def train_tokenizer(texts: list[str], vocab_size: int, out_dir: str) -> None:
    """sentencepiece BPE (byte fallback, no dummy prefix, spaces kept) -> tokenizer.model,
    the same tokenizer as tokenizer.json for transformers, and tokenizer_config.json."""
    # Sentences are lines; an iterator and an in-memory writer keep file paths out of the model.
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter("\n".join(texts).split("\n")), model_writer=f,
            vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0,
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, split_digits=True, allow_whitespace_only_pieces=True,
            control_symbols=ROLE_TOKENS, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            max_sentence_length=1 << 16, num_threads=1, seed_sentencepiece_size=1 << 20,
            minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out_dir, "tokenizer.model"))
    to_hf_tokenizer(sp).save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": sp.id_to_piece(sp.bos_id()),
        "eos_token": sp.id_to_piece(sp.eos_id()),
        "unk_token": sp.id_to_piece(sp.unk_id()),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def to_hf_tokenizer(sp: spm.SentencePieceProcessor) -> Tokenizer:
    """The sentencepiece BPE model as a `tokenizers` BPE with identical encodings: a merge
    (left, right) for every split of a piece into two pieces, ranked by the piece's id."""
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    merges = []
    for piece, i in vocab.items():
        if sp.is_control(i) or sp.is_byte(i) or sp.is_unknown(i):
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((i, vocab[left], vocab[right]))
    merges = [(sp.id_to_piece(l), sp.id_to_piece(r)) for _, l, r in sorted(merges)]
    tok = Tokenizer(BPE(vocab, merges, unk_token=sp.id_to_piece(sp.unk_id()), fuse_unk=True,
                        byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), normalized=False, special=True)
                            for i in range(n) if sp.is_control(i) or sp.is_unknown(i)])
    bos = sp.id_to_piece(sp.bos_id())
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, sp.bos_id())])
    return tok


def token_stream(tokenizer, docs: dict[str, str], chat_every: int = 0) -> np.ndarray:
    """All docs as one id stream, each `<s> doc </s>`; with chat_every=2 every second doc is a
    chat (user asks about the topic, the assistant answers with the doc)."""
    ids = []
    for i, (name, text) in enumerate(docs.items()):
        if chat_every and i % chat_every == 1:
            question = f"Tell me about {name.replace('-', ' ')}."
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}, {"role": "assistant", "content": text}],
                add_generation_prompt=False)
            ids += tokenizer.encode(text, add_special_tokens=False)
        else:
            ids += [tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False)
            ids.append(tokenizer.eos_token_ids[0])
    return np.asarray(ids, np.int32)


# ---------------------------------------------------------------------------- training

def hf_config(arch: dict, vocab_size: int, bos: int, eos: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **arch,
        "head_dim": arch["hidden_size"] // arch["num_attention_heads"],
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


def make_row_losses(model):
    """Mean next-token cross entropy of each row of tokens [B, T + 1] -> [B]."""
    def row_losses(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
        logits = model.apply({"params": params}, inputs, positions, method=model.forward_logits)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(axis=1)
    return row_losses


def perplexity(row_losses, params, stream: np.ndarray, seq_len: int, batch: int = 16) -> float:
    """exp(mean next-token loss) over non-overlapping windows of seq_len + 1 tokens."""
    n = (len(stream) - 1) // seq_len
    windows = np.stack([stream[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])
    losses = []
    for i in range(0, n, batch):
        chunk = windows[i:i + batch]
        padded = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), axis=0)])
        losses.append(np.asarray(row_losses(params, padded))[:len(chunk)])
    return float(np.exp(np.concatenate(losses).mean()))


def train(name, arch, vocab_size, train_ids, heldout_ids, args, log):
    """Returns the trained params, the HF config, the parameter count and the jitted row-loss function."""
    hf = hf_config(arch, vocab_size, bos=1, eos=2)
    cfg = ModelConfig.from_hf_dict(hf)
    model = build_model(cfg)
    params = init_params(cfg, jax.random.key(args.seed))
    steps = args.steps if name == "main" else args.draft_steps
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, steps // 10 + 1),
                                                  steps, end_value=args.lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay))
    opt_state = opt.init(params)
    row_losses = make_row_losses(model)
    eval_losses = jax.jit(row_losses)

    @jax.jit
    def step_fn(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: row_losses(p, tokens).mean())(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    n_params = sum(x.size for x in jax.tree.leaves(params))
    log(f"\n### {name} model: {n_params:,} parameters, {steps} steps of "
        f"{args.batch_size} x {args.seq_len} tokens\n")
    log("| step | train loss | held-out ppl | tokens/s | elapsed s |\n|---|---|---|---|---|")
    rng = np.random.default_rng(args.seed)
    t0, tokens_seen, recent = time.time(), 0, []
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(train_ids) - args.seq_len - 1, size=args.batch_size)
        batch = np.stack([train_ids[s:s + args.seq_len + 1] for s in starts])
        params, opt_state, loss = step_fn(params, opt_state, batch)
        tokens_seen += batch.size - args.batch_size
        recent.append(loss)
        if step % args.log_every == 0 or step == steps:
            mean_loss = float(np.mean([float(x) for x in recent]))
            recent = []
            elapsed = time.time() - t0
            ppl = ""
            if step % args.eval_every == 0 or step == steps:
                ppl = f"{perplexity(eval_losses, params, heldout_ids, args.seq_len):.2f}"
            log(f"| {step} | {mean_loss:.3f} | {ppl} | {tokens_seen / elapsed:,.0f} | {elapsed:.0f} |")
    return params, hf, n_params, eval_losses


def samples(cfg, params, tokenizer, max_new_tokens: int) -> list[tuple[str, str]]:
    prompts = [(p, tokenizer.encode(p)) for p in SAMPLE_PROMPTS]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the with statement."}])
    prompts.append((chat, tokenizer.encode(chat, add_special_tokens=False)))
    out = greedy_generate(cfg, params, [ids for _, ids in prompts], max_new_tokens)
    eos = set(tokenizer.eos_token_ids)
    results = []
    for (text, _), ids in zip(prompts, out):
        ids = ids[:next((i for i, t in enumerate(ids) if t in eos), len(ids))]
        results.append((text, tokenizer.decode(ids)))
    return results


def machine() -> str:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} cores (load average {load:.1f} at start, shared), "
            f"Python {platform.python_version()}, jax {jax.__version__} ({jax.default_backend()})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "jaxserve", "assets", "tiny"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--draft-steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--sample-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topics", type=int, default=None, help="use only the first N topics (smoke runs)")
    p.add_argument("--smoke", action="store_true", help="1-layer 32-wide models (tests the script)")
    args = p.parse_args(argv)
    transformers.logging.set_verbosity_error()  # long documents trip the model_max_length warning
    t_start = time.time()
    out = os.path.abspath(args.out)
    draft_out = os.path.join(out, "draft")
    os.makedirs(draft_out, exist_ok=True)
    lines = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    log("# Training log of the embedded tiny models\n")
    log(f"Command: `python scripts/train_tiny_model.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ")
    log(f"Machine: {machine()}\n")
    train_docs, heldout_docs = split_corpus(args.topics)
    train_tokenizer(list(train_docs.values()), args.vocab_size, out)
    for fn in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(out, fn), os.path.join(draft_out, fn))
    tokenizer = load_tokenizer(out)
    train_ids = token_stream(tokenizer, train_docs, chat_every=2)
    heldout_ids = token_stream(tokenizer, heldout_docs)
    log(f"Corpus: `pydoc_data.topics` of Python {platform.python_version()}: {len(train_docs)} training "
        f"topics ({sum(map(len, train_docs.values())):,} characters, {len(train_ids):,} tokens, every "
        f"second one as a chat turn), {len(heldout_docs)} held out ({', '.join(heldout_docs)}; "
        f"{len(heldout_ids):,} tokens).  ")
    log(f"Tokenizer: sentencepiece BPE, {tokenizer.vocab_size} pieces, byte fallback, "
        f"role tokens {', '.join(ROLE_TOKENS)}.  ")
    log(f"Optimizer: AdamW (b2 0.95, weight decay {args.weight_decay}), peak lr {args.lr}, "
        f"warmup {args.warmup}, cosine to 10%, grad clip 1.0, seed {args.seed}.")

    results, sample_out = [], []
    for name, arch, path in (("main", SMOKE if args.smoke else MAIN, out),
                             ("draft", SMOKE if args.smoke else DRAFT, draft_out)):
        t0 = time.time()
        params, hf, n_params, eval_losses = train(name, arch, tokenizer.vocab_size, train_ids,
                                                  heldout_ids, args, log)
        save_pretrained(params, hf, path, dtype=jnp.bfloat16)
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, f, indent=2)
        # Evaluate what was written (bfloat16 weights read back as float32).
        cfg = ModelConfig.from_pretrained(path)
        loaded = load_params(path, cfg)
        ppl = perplexity(eval_losses, loaded, heldout_ids, args.seq_len)
        train_ppl = perplexity(eval_losses, loaded, train_ids[:len(heldout_ids)], args.seq_len)
        size = os.path.getsize(os.path.join(path, "model.safetensors"))
        results.append((name, n_params, size, train_ppl, ppl, time.time() - t0))
        log(f"\n{name}: saved bfloat16 weights, {size / 1e6:.1f} MB; perplexity after loading them: "
            f"held-out {ppl:.2f}, training text (first {len(heldout_ids):,} tokens) {train_ppl:.2f}; "
            f"{time.time() - t0:.0f} s")
        if name == "main" and args.sample_tokens:
            sample_out = samples(cfg, loaded, tokenizer, args.sample_tokens)

    log("\n## Summary\n")
    log("| model | parameters | model.safetensors | held-out ppl | training-text ppl | train time s |\n|---|---|---|---|---|---|")
    for name, n, size, train_ppl, ppl, secs in results:
        log(f"| {name} | {n:,} | {size / 1e6:.1f} MB | {ppl:.2f} | {train_ppl:.2f} | {secs:.0f} |")
    log(f"\nTotal wall time: {time.time() - t_start:.0f} s; process CPU time: {time.process_time():.0f} s "
        f"(what a quiet machine's cores would spend).\n")
    if sample_out:
        log(f"## Greedy samples of the main model ({args.sample_tokens} new tokens, stop at eos)\n")
    for prompt, text in sample_out:
        log(f"- Prompt `{prompt!r}`:\n\n  ```text\n  {(text).replace(chr(10), chr(10) + '  ')}\n  ```")
    with open(os.path.join(out, "TRAINING.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
