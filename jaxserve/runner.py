"""ModelRunner: packs a scheduled ragged batch into bucketed fixed-shape arrays and runs one
jit-compiled step (KV write + paged attention + logits), then samples on device. `launch`
returns as soon as the computations are dispatched, `collect` waits for their results (the
engine plans the next step in between; decode inputs still PENDING on the host are read from the
previous step's sampled tokens on the device).

Rows of a step: prefill rows first (sequences bringing more than one new token), then decode
rows (one new token each, or a verify row's last token and k proposals, every one sampled;
longest context first), padded to the static shapes of buckets.py,
all compiled at warm-up (the pieces of step.py, which `jaxserve check` compiles for TPU too;
the packing: packing.py).
Page tables are always full width: every attention path reads K/V only up to the real context
lengths (the XLA path in a loop bounded by them, see pallas_kernels/paged_attention/xla.py),
so padded rows and unused page-table columns cost next to nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import multihost, parallel, pooling, prompt_logprobs, sizing, warmup
from jaxserve.attention import resolve_backend
from jaxserve.buckets import Buckets, bucket, drop_lone_group
from jaxserve.compilations import CompileCounter
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.executables import Executables, abstract, context_digest, key
from jaxserve.kv_cache import KVCache, page_bytes_per_chip
from jaxserve.kv_groups import kv_groups
from jaxserve.lora import Adapters, StepLora
from jaxserve.models import build_model
from jaxserve.packing import pack
from jaxserve.sampling import SamplingMetadata, SampleOutput, metadata_for
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.scheduler import SchedulerOutput
from jaxserve.sequence_parallel import sequence_parallel_prefill
from jaxserve.step import (make_multi_step, make_step, multi_step_variant, multi_step_variants, page_copy_batches,
                           serving_sample, table_groups)
from jaxserve.step_ops import (MULTI_STEP, POOL, PROMPT_LOGPROBS, SAMPLE, SEQUENCE_PARALLEL, STEP, Launched, Op,
                               hidden_state_ops)

if TYPE_CHECKING:   # the draft imports this module
    from jaxserve.spec_decode.draft import DraftModel

log = logging.getLogger(__name__)


class SampleResult(NamedTuple):
    token: int
    logprob: float
    top: list[tuple[int, float]]  # requested top-N (token id, logprob), most likely first
    rank: int | None = None       # the token's rank (1 = most likely); prompt logprobs only


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, engine_cfg: EngineConfig, mesh=None,
                 dtype=jnp.float32, lora: Adapters | None = None, draft: DraftModel | None = None):
        CompileCounter.install()
        self.max_model_len = engine_cfg.max_model_len or cfg.max_position_embeddings
        self.cfg = cfg = cfg.serving(self.max_model_len)
        self.ecfg, self.dtype = engine_cfg, dtype
        self.mesh = mesh if mesh is not None else parallel.make_mesh(engine_cfg.mesh)
        self.backend = resolve_backend(engine_cfg.attention_backend, parallel.platform(self.mesh), cfg.head_dim,
                                       engine_cfg.kv_cache_dtype)
        self.model = build_model(cfg, dtype)
        self.page_size = engine_cfg.page_size
        self.max_pages_per_seq = sizing.pages_per_seq(cfg, engine_cfg)
        self.params = jax.device_put(params, parallel.param_shardings(params, self.mesh, cfg))
        self.lora = lora   # LoRA adapters' slots (jaxserve/lora.py): each step then takes a StepLora
        self.kv_groups = kv_groups(cfg, engine_cfg)   # the hybrid cache's layers and page tables
        # draft: a draft model, whose pool will have this pool's pages (spec_decode/draft.py)
        self.num_pages = engine_cfg.num_pages or self._pages_that_fit(draft)
        # Multi-host: process 0 broadcasts every step (see jaxserve/multihost.py); the others
        # build the same runner and `follow`. The pool size must agree (free memory may not).
        self.broadcaster = None
        if jax.process_count() > 1:
            if self.mesh.devices.size != jax.device_count():
                raise ValueError(f"multi-host: the mesh {dict(self.mesh.shape)} must span all "
                                 f"{jax.device_count()} devices of the {jax.process_count()} processes")
            self.num_pages = int(multihost.broadcast_arrays(
                [np.array([self.num_pages], np.int32)] if multihost.is_leader() else None)[0][0])
            multihost.warmup()
            self.broadcaster = multihost.Broadcaster() if multihost.is_leader() else None
        self.kv_cache = KVCache.zeros(cfg, self.mesh, self.num_pages, self.page_size, dtype, engine_cfg.kv_cache_dtype,
                                      self.kv_groups)
        self.table_groups = table_groups(self.kv_cache)   # the step's page tables' group axis (1: none)
        self.buckets = Buckets(engine_cfg, self.mesh.shape["seq"], parallel.platform(self.mesh), self.backend)
        self.max_copies = engine_cfg.max_num_seqs
        self._step = make_step(self.model, cfg, self.mesh, self.backend)
        self._multi_step = make_multi_step(self.model, cfg, self.mesh, self.backend, self.buckets.max_logit_rows)
        # The latest batched step's sampled tokens on the device, padded to a fixed length, and
        # (process 0) the row of each sequence it sampled: the next step's PENDING tokens.
        self._last_sampled = self.no_sampled_tokens()
        self._last_run = self.no_sampled_tokens(self.ecfg.decode_steps)   # the latest multi-step decode's samples
        self._last_rows: dict[int, int] = {}
        self._unsampled_logits = None   # the batched step's, while its sampler waits (`sample`)
        # The step shapes a batch may run in (None: any): step_shapes "largest"'s, or while warm-up
        # builds the others in the background, those built so far (jaxserve/warmup.py).
        self.ready_shapes = (frozenset(self.buckets.warmup_shapes(self.prefills_sequence_parallel))
                             if engine_cfg.step_shapes == "largest" else None)
        self.background_warmup = None
        # Warm-up's executables, called by argument shapes (`_run`), stored beside JAX's cache.
        store = engine_cfg.compilation_cache_dir and os.path.join(engine_cfg.compilation_cache_dir, "executables")
        devices = list(self.mesh.devices.flat)
        self.executables = Executables(store, devices, context_digest(
            devices, cfg, engine_cfg.program_settings(), jnp.dtype(dtype).name, self.mesh, self.backend, abstract(self.params),
            abstract(self.kv_cache), lora and abstract(lora.weights)))   # the adapters' targets too

    @property
    def prefills_sequence_parallel(self) -> bool:
        """With a "seq" mesh axis, each prefill chunk runs sequence-parallel on its own
        (sequence_parallel_prefill) and the batched step takes only the decode rows."""
        return self.mesh.shape["seq"] > 1

    def _pages_that_fit(self, draft: DraftModel | None) -> int:
        device = self.mesh.local_devices[0]
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:   # CPU: kv_cache_mb, and at least one full-length sequence
            page_bytes = page_bytes_per_chip(self.cfg, self.dtype, self.page_size, 1, tpu=False,
                                             kv_cache_dtype=self.ecfg.kv_cache_dtype, groups=self.kv_groups)
            return max(self.ecfg.kv_cache_mb * 2**20 // page_bytes, sizing.pool_pages_per_seq(self.cfg, self.ecfg,
                                                                                           self.kv_groups))
        # an accelerator: a share of what the (placed) weights leave free, or a clear refusal
        return sizing.kv_pool_pages(
            self.cfg, self.ecfg, self.dtype, model_axis=self.mesh.shape["model"], hbm_bytes=stats["bytes_limit"],
            used_bytes=stats.get("bytes_in_use", 0), tpu=device.platform == "tpu",
            chip=sizing.TPU_DEVICE_KINDS.get(device.device_kind, device.device_kind), groups=self.kv_groups,
            name=f"{self.cfg.architecture} ({self.cfg.num_params / 1e9:.1f}B parameters)", draft=draft)

    # ---- one step ----
    def launch(self, out: SchedulerOutput, seeds: dict[int, int], sample_later: bool = False) -> "Launched":
        """Start the scheduled batch's computations (JAX dispatch returns before they finish);
        `collect` waits for their results. `seeds` gives each sampling sequence's seed. A decode
        row whose input token is PENDING reads it on the device from the batched step launched
        just before, which must have sampled it (see jaxserve/engine.py). `sample_later`: the
        batched step's sampler waits, its logits on the device, for `sample`."""
        split = self.prefills_sequence_parallel
        ops, metadata = [], None
        for s in out.scheduled:
            if split and s.is_prefill_row:
                ops.append(self._sequence_parallel_op(s, seeds))
                tokens = len(ops[-1].arrays[-3])   # its tokens (after the LoRA slots, if any)
                ops += hidden_state_ops(prompt_logprobs.pack([(s, 0)], tokens),
                                        pooling.pack([(s, 0)], tokens, self.ecfg.max_num_seqs))
        rest = [s for s in out.scheduled if not (split and s.is_prefill_row)]
        if rest:
            batch = pack(dataclasses.replace(out, scheduled=rest), self.buckets, self.max_pages_per_seq,
                         self.num_pages, self.page_size, self.ready_shapes, self.table_groups)
            seqs = batch.sampling_seqs
            lora = () if self.lora is None else (batch.lora_slots,)   # the op's first array (see `replay`)
            token_src = np.full(len(batch.arrays[0]), -1, np.int32)   # >= 0: the previous step's row
            for position, seq in batch.pending:
                token_src[position] = self._last_rows[seq.seq_id]
            # logits_index (the last array): the logits' rows
            metadata = functools.partial(metadata_for, seqs, seeds, len(batch.arrays[-1]), self.max_model_len)
            if out.decode_steps > 1:   # a decode-only batch (the engine's rule): sampling row i is row i
                if batch.num_prefill_rows or batch.prompt_logprobs is not None:
                    raise ValueError("a multi-step decode with prompt rows")
                steps = {s.seq.seq_id: s.num_steps for s in rest}
                row_steps, pending = np.zeros((2, len(batch.arrays[-1])), np.int32)
                row_steps[:len(seqs)] = [steps[seq.seq_id] for seq in seqs]
                pending[:len(seqs)] = [len(seq.output_token_ids) - seq.num_known_outputs for seq in seqs]
                md = metadata()
                # which compiled variant (multi_step_variants): filters -1 None, 0 False, 1 True
                filters = multi_step_variant(multi_step_variants(parallel.platform(self.mesh)), md, self.cfg.vocab_size)
                filters = -1 if filters is None else int(filters)
                ops.append(Op([MULTI_STEP, self.ecfg.decode_steps, filters],
                               (*lora, *batch.arrays, token_src, row_steps, pending), seqs, md))
            else:
                ops.append(Op([STEP, batch.num_prefill_rows, batch.max_q, batch.decode_q, int(sample_later)],
                               (*lora, *batch.arrays, token_src), seqs, None if sample_later else metadata()))
            self._last_rows = {seq.seq_id: i for i, seq in enumerate(seqs)}
            ops += hidden_state_ops(batch.prompt_logprobs, batch.pooling)
        message = [np.asarray(out.page_copies, np.int32).reshape(-1, 2)]
        for op in ops:
            message += op.message()
        if self.broadcaster is not None:
            message = self.broadcaster.send(message)
        later = functools.partial(metadata, launched=True) if sample_later else None
        return Launched(ops, self.replay(message), later)

    def sample(self, launched: "Launched") -> "Launched":
        """Launch the sampler that `launch(sample_later=True)` left waiting, its arrays built now
        (grammar masks and penalty history from the sequences' outputs as the host knows them now:
        the engine collected the step before first), as a message of its own (multi-host)."""
        md = launched.sampler_arrays()
        message = [np.zeros((0, 2), np.int32), *Op([SAMPLE], (), [], md).message()]
        if self.broadcaster is not None:
            message = self.broadcaster.send(message)
        [sampled] = self.replay(message)
        step = next(i for i, op in enumerate(launched.ops) if op.static[0] == STEP)
        return launched._replace(sampled=[sampled if i == step else s for i, s in enumerate(launched.sampled)],
                                 sampler_arrays=None)

    def collect(self, launched: "Launched") -> dict[int, list[SampleResult]]:
        """Wait for a launched batch; returns seq_id -> the SampleResults of a sampling row's
        positions, in order (one, a verify row's k + 1, or a multi-step decode's num_steps)."""
        results = {}
        for op, sampled in zip(launched.ops, launched.sampled):
            if not op.seqs:
                continue
            if op.static[0] == PROMPT_LOGPROBS:
                prompt_logprobs.accumulate(op.seqs, op.counts, op.arrays[1], multihost.local_value(sampled),
                                           SampleResult)
                continue
            if op.static[0] == POOL:
                pooling.accumulate(op.seqs, jax.device_get(multihost.local_value(sampled)))
                continue
            res: SampleOutput = jax.device_get(multihost.local_value(sampled))
            if op.static[0] == MULTI_STEP:   # [steps, rows]; row i ran op.arrays[-2][i] steps
                row_steps = op.arrays[-2].tolist()
            else:
                res, row_steps = jax.tree.map(lambda a: a[None], res), [1] * len(op.seqs)
            # As Python lists at once: per-row numpy indexing cost more than the rest of a row's collection.
            tokens, logprobs = res.tokens.tolist(), res.logprobs.tolist()
            for i, seq in enumerate(op.seqs):
                n, row = seq.sampling.logprobs, results.setdefault(seq.seq_id, [])
                for k in range(row_steps[i]):
                    top = list(zip(res.top_ids[k, i, :n].tolist(), res.top_logprobs[k, i, :n].tolist())) if n else []
                    row.append(SampleResult(tokens[k][i], logprobs[k][i], top))
        return results

    def _sequence_parallel_op(self, s, seeds: dict[int, int]) -> "Op":
        """One prefill chunk for sequence_parallel_prefill: its tokens padded to a token bucket
        (a multiple of the "seq" size), (new, cached) token counts, the full-width page row."""
        seq, n, start = s.seq, s.num_query_tokens, s.seq.num_computed_tokens
        tokens = np.zeros(bucket(n, self.buckets.tokens), np.int32)
        tokens[:n] = s.query_token_ids
        rows = np.zeros((len(seq.page_tables), self.max_pages_per_seq), np.int32)
        for row, table in zip(rows, seq.page_tables):
            row[:len(table)] = table
        seqs = [seq] if s.num_sampled else []
        lora = () if self.lora is None else (np.where(np.arange(len(tokens)) < n, seq.lora_slot, 0).astype(np.int32),)
        return Op([SEQUENCE_PARALLEL], (*lora, tokens, np.array([n, start], np.int32), drop_lone_group(rows)), seqs,
                  metadata_for(seqs, seeds, 1, self.max_model_len))

    def replay(self, message: list[np.ndarray]) -> list[SampleOutput | None]:
        """Launch one step's computations from its host arrays (see `Op.message`): the page
        copies, then each op (a sequence-parallel prefill or the batched step) and its sampler.
        Every process of a multi-host mesh runs this with the same message, process 0 from
        `launch`, the others from `follow`. Returns each op's samples (None: no row samples)."""
        copies, *rest = message
        if len(copies):
            self.copy_pages(copies)
        sampled, hidden, hidden_split = [], None, False
        while rest:
            (num_arrays, num_md, kind, *static), *rest = rest
            arrays, md, rest = rest[:num_arrays], rest[num_arrays:num_arrays + num_md], rest[num_arrays + num_md:]
            if kind == PROMPT_LOGPROBS:   # over the hidden states of the step (or prefill) just before
                sampled.append(self._prompt_logprobs(hidden, *arrays, sequence_parallel=hidden_split))
                continue
            if kind == POOL:   # likewise
                sampled.append(self._pool(hidden, *arrays, sequence_parallel=hidden_split))
                continue
            lora = ()
            if self.lora is not None and kind in (STEP, MULTI_STEP, SEQUENCE_PARALLEL):   # the tokens' slots first
                lora, arrays = (StepLora(self.lora.weights, arrays[0]),), arrays[1:]
            if kind == MULTI_STEP:   # samples inside; its arrays end with row_steps, pending
                outs, self.kv_cache, self._last_sampled, self._last_run = self._run(
                    "multi_step", self._multi_step, (self.params, self.kv_cache),
                    (*arrays, self._last_sampled, self._last_run, SamplingMetadata(*md), *lora), steps=int(static[0]),
                    filters=None if static[1] < 0 else bool(static[1]))
                sampled.append(outs)
                continue
            if kind == SAMPLE:   # the sampler of the batched step before, sent on its own (`sample`)
                logits, self._unsampled_logits = self._unsampled_logits, None
            elif kind == STEP:   # its arrays end with token_src: PENDING tokens are read from _last_sampled
                logits, self.kv_cache, hidden = self._run(
                    "step", self._step, (self.params, self.kv_cache), (*arrays, self._last_sampled, *lora),
                    num_prefill_rows=int(static[0]), max_q=int(static[1]), decode_q=int(static[2]))
                hidden_split = False
                if static[3]:   # its sampler comes later
                    self._unsampled_logits = logits
            else:
                tokens, (num_tokens, num_cached), row = arrays
                logits, self.kv_cache, hidden = self._run("sequence_parallel_prefill", self._sp_prefill,
                                                          (self.params, self.kv_cache),
                                                          (tokens, num_tokens, num_cached, row, *lora))
                hidden_split = True
            out, padded = self._sample(logits, SamplingMetadata(*md)) if md else (None, None)
            sampled.append(out)
            if kind in (STEP, SAMPLE) and md:
                self._last_sampled = padded
        return sampled

    def _run(self, name: str, fn, fixed: tuple, args: tuple, **static):
        """fn(*fixed, *args, **static) through warm-up's executable for the shapes of `args` (see
        jaxserve/executables.py), else through fn (jit). `fixed`: the weights, the KV cache."""
        executable = self.executables.get(key(name, args, **static))
        return executable(*fixed, *args) if executable is not None else fn(*fixed, *args, **static)

    def no_sampled_tokens(self, *steps: int) -> jax.Array:
        """_last_sampled (or with `steps`, _last_run) before any step has sampled: zeros, replicated."""
        return jax.device_put(np.zeros((*steps, self.buckets.max_logit_rows), np.int32), parallel.replicated(self.mesh))

    def _sample(self, logits, md: SamplingMetadata) -> tuple[SampleOutput, jax.Array]:
        """The samples, and their tokens padded to max_logit_rows (the next _last_sampled)."""
        return self._run("sample", serving_sample, (), (logits, md), length=self.buckets.max_logit_rows)

    def _prompt_logprobs(self, hidden, index, targets, sequence_parallel: bool = False):
        """Scored from a batched step's hidden states, or a sequence-parallel prefill's (split
        over "seq": an executable of its own, same shapes); so are `_pool`'s sums."""
        name = "sequence_parallel_prompt_logprobs" if sequence_parallel else "prompt_logprobs"
        return self._run(name, self._scorer, (self.params,), (hidden, index, targets))

    def _pool(self, hidden, index, segments, sequence_parallel: bool = False):
        name = "sequence_parallel_pool" if sequence_parallel else "pool"
        return self._run(name, self._pooler, (), (hidden, index, segments))

    @property
    def pools(self) -> bool:
        """An embedding engine's runner: warm-up builds the pooling sums, not the prompt-logprobs scorer."""
        return self.ecfg.runner == "pooling"

    @property
    def _pooler(self):
        return functools.partial(pooling.compute, num_segments=self.ecfg.max_num_seqs)

    @property
    def _sp_prefill(self):
        return functools.partial(sequence_parallel_prefill, self.model, self.mesh, backend=self.backend)

    @property
    def _scorer(self):
        return functools.partial(prompt_logprobs.compute, self.model, num_top=MAX_LOGPROBS,
                                 logits_sharding=self._step.keywords["logits_sharding"])

    def follow(self) -> int:
        """The loop of processes other than 0 (multi-host): replay process 0's steps until it
        stops serving. Call after the same warm-up as process 0's. Returns the steps run."""
        return multihost.follow(self.replay)

    def pause_followers(self) -> None:
        """Process 0 has nothing to run: followers wait on the host, not in a collective."""
        if self.broadcaster is not None:
            self.broadcaster.pause()

    def stop_followers(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.stop()

    def copy_pages(self, copies) -> None:
        """copies: (src, dst) page pairs, a list or an int32 [n, 2] array."""
        for src, dst in page_copy_batches(copies, self.max_copies, self.num_pages):
            self.kv_cache = self._run("copy_kv_pages", KVCache.copy_pages, (self.kv_cache,), (src, dst))

    def poison_pages(self, out: SchedulerOutput, stale: list[int]) -> SchedulerOutput:
        """Test build (EngineConfig.poison_freed_pages): NaN into the K/V of every `stale` page
        (freed or newly taken since the last step), so a step that reads K/V its sequence did not
        write (or copy) turns its output NaN. `out`'s page copies run first (a copy's source may be
        a cached page evicted for a new owner in this very schedule) and their destinations are
        spared; returns `out` without them. One fixed-size batch padded with page num_pages (dropped)."""
        self.copy_pages(out.page_copies)
        copied = {dst for _, dst in out.page_copies}
        pages = [p for p in stale if p not in copied]
        batch = np.full(self.num_pages, self.num_pages, np.int32)
        batch[:len(pages)] = pages
        self.kv_cache = self.kv_cache.fill_pages(batch, np.float32("nan"))
        return dataclasses.replace(out, page_copies=[])

    # ---- warm-up (jaxserve/warmup.py) ----
    def warmup(self, background: bool = False) -> int:
        """Build every step shape's executables and what runs beside them (compiled side by side,
        or loaded from the executable store), and run each step shape once; with `background`,
        only what serves every batch before returning, the rest on a thread (`wait_warm`).
        Returns the compilations it took before returning."""
        return warmup.warm_up(self, background)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for the background warm-up, if any; True once every step shape is built."""
        return self.background_warmup is None or self.background_warmup.done.wait(timeout)

    def stop_warmup(self) -> None:
        if self.background_warmup is not None:
            self.background_warmup.stop()
