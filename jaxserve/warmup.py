"""Warm-up: every executable serving calls, built before it is called (lowered and compiled side
by side in threads, or loaded from the executable store: jaxserve/executables.py), and each step
shape run once (an XLA:CPU executable's first run costs ~0.2-0.3 s more than the next ones,
compiled or loaded alike: paid here, not by a request).

In the background (`warm_up(runner, background=True)`, what the server does): before serving,
only what serves every batch: the largest decode shape and the largest prefill shape
(buckets.largest), the samplers of their logit rows, and what runs beside them. Until the others
are built, a batch pads up into the smallest shape built that holds it (buckets.cover over
`runner.ready_shapes`), so serving never compiles. A thread then builds the other step shapes a
few at a time, each joining `runner.ready_shapes` once its step, sampler variants and
prompt-logprobs scorer (an embedding engine's: pooling sums; and, for a decode shape with decode_steps > 1, its multi-step decode) are
all built (and, on a CPU, run once on a scratch
KV pool of its own: serving holds the real one; an accelerator's pool fills its memory, so there
the first request of a shape pays its first run).

A multi-host engine builds everything before serving: every process must hold the executable of
whatever shape process 0 picks.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time

import jax
import numpy as np

from jaxserve import parallel
from jaxserve.buckets import StepShape, largest
from jaxserve.compilations import CompileCounter
from jaxserve.executables import key, lower
from jaxserve.kv_cache import KVCache
from jaxserve.scheduler import SchedulerOutput
from jaxserve.step import (empty_sequence_parallel_prefill, lower_step, multi_step_arrays, multi_step_variants,
                           page_copy_batches, sampler_args, serving_sample, step_arrays)

log = logging.getLogger(__name__)


def warm_up(runner, background: bool = False) -> int:
    """Build what serves every batch (everything, unless `background`: then the other step
    shapes follow on a thread, see the module docstring); returns the compilations it took."""
    before, t0 = CompileCounter.count, time.perf_counter()
    shapes = runner.buckets.warmup_shapes(runner.prefills_sequence_parallel)
    first = largest(shapes) if background and jax.process_count() == 1 else shapes
    kv = runner.kv_cache.abstract()
    _build(runner, first, kv, beside=True)
    runner.kv_cache = _run_once(runner, first, runner.kv_cache)
    if runner.prefills_sequence_parallel:   # the sequence-parallel prefill of each token bucket, and its scorer
        for t in runner.buckets.tokens:
            _, runner.kv_cache, hidden = runner._run(
                "sequence_parallel_prefill", runner._sp_prefill, (runner.params, runner.kv_cache),
                _sequence_parallel_args(runner, t))
            _run_reader(runner, hidden, t, sequence_parallel=True)
    runner.copy_pages([(0, 0)])
    if runner.ecfg.poison_freed_pages:   # the test build's poisoning (runner.poison_pages), of no page
        runner.poison_pages(SchedulerOutput([], [], []), [])
    jax.block_until_ready(runner.kv_cache)
    rest = [s for s in shapes if s not in first]
    n = CompileCounter.count - before
    log.info("warm-up: %d compilations, %d executables loaded from the store (%d of %d step shapes) in %.1fs%s",
             n, runner.executables.loaded, len(first), len(shapes), time.perf_counter() - t0,
             "; the others follow in the background" if rest else "")
    if rest:
        runner.ready_shapes = frozenset(first)
        runner.background_warmup = Background(runner, rest, kv)
    return n


class Background:
    """Builds `shapes` on a thread, os.cpu_count() at a time, adding each batch of them to
    runner.ready_shapes (None once all are: no limit)."""

    def __init__(self, runner, shapes: list[StepShape], kv):
        self.pending = len(shapes)   # step shapes not built yet
        self.done = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, args=(runner, shapes, kv), name="jaxserve-warmup",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Build nothing more (what is being compiled finishes first)."""
        self._stop = True
        self._thread.join(timeout)

    def _run(self, runner, shapes: list[StepShape], kv) -> None:
        before, t0 = CompileCounter.count, time.perf_counter()
        try:
            # A scratch pool on a CPU (see the module docstring): serving holds the real one.
            scratch = (KVCache.zeros(runner.cfg, runner.mesh, runner.num_pages, runner.page_size, runner.dtype,
                                     runner.ecfg.kv_cache_dtype, runner.kv_groups)
                       if parallel.platform(runner.mesh) == "cpu" else None)
            step = os.cpu_count() or 1
            for i in range(0, len(shapes), step):
                if self._stop:
                    return
                batch = shapes[i:i + step]
                _build(runner, batch, kv, beside=False)
                if scratch is not None:
                    scratch = _run_once(runner, batch, scratch)
                    jax.block_until_ready(scratch)
                runner.ready_shapes = runner.ready_shapes | frozenset(batch)
                self.pending -= len(batch)
            runner.ready_shapes = None
            log.info("warm-up in the background: %d more step shapes in %.1fs (%d compilations)", len(shapes),
                     time.perf_counter() - t0, CompileCounter.count - before)
        except Exception:   # serving goes on in the shapes built
            log.exception("warm-up in the background failed; serving goes on in %d step shape(s)",
                          len(runner.ready_shapes))
        finally:
            self.done.set()


def _build(runner, shapes: list[StepShape], kv, beside: bool) -> None:
    """Build the executables of `shapes`: each step and the sampler variants of its logit rows,
    then the prompt-logprobs scorer (pooling: the pooling sums) of its token count, lowered for the step's hidden states'
    sharding. `beside`: also the page copy and the sequence-parallel prefills (and the samplers
    of their one row)."""
    rows = [s.logit_rows for s in shapes] + ([1] if beside and runner.prefills_sequence_parallel else [])
    work = []   # the longest compilations first (steps, the most tokens first): the threads end together
    for shape in sorted(shapes, key=lambda s: -s.tokens):
        args, static = _step_args(runner, shape)
        work.append((key("step", args, **static), functools.partial(
            lower_step, runner._step, runner.params, kv, shape, runner.max_pages_per_seq,
            runner.num_pages * runner.page_size, runner.no_sampled_tokens(), _lora_weights(runner))))
    work += [_lowering("multi_step", runner._multi_step, (runner.params, kv), args, steps=runner.ecfg.decode_steps,
                       filters=filters)
             for args, filters in _multi_steps(runner, shapes)]
    if beside and runner.prefills_sequence_parallel:
        work += [_lowering("sequence_parallel_prefill", runner._sp_prefill, (runner.params, kv),
                           _sequence_parallel_args(runner, t))
                 for t in runner.buckets.tokens]
    work += [_lowering("sample", serving_sample, (), args, length=runner.buckets.max_logit_rows)
             for _, args in sampler_args(rows, runner.cfg.vocab_size, runner.mesh, runner.max_model_len)]
    if beside:
        work.append(_lowering("copy_kv_pages", KVCache.copy_pages, (kv,),
                              next(page_copy_batches([(0, 0)], runner.max_copies, runner.num_pages))))
    runner.executables.build(dict(work))
    work = []
    for shape in shapes:
        args, static = _step_args(runner, shape)
        hidden = _outputs(runner.executables.get(key("step", args, **static)))[2]
        work.append(_reader_lowering(runner, hidden, args[0], sequence_parallel=False))
    if beside and runner.prefills_sequence_parallel:   # likewise, of hidden states split over "seq"
        for t in runner.buckets.tokens:
            args = _sequence_parallel_args(runner, t)
            hidden = _outputs(runner.executables.get(key("sequence_parallel_prefill", args)))[2]
            work.append(_reader_lowering(runner, hidden, args[0], sequence_parallel=True))
    runner.executables.build(dict(work))


def _run_once(runner, shapes: list[StepShape], kv_cache):
    """Run each step shape once on `kv_cache` (writing nothing), and its prompt-logprobs scorer (or pooling sums),
    on the arrays serving gives them; returns the pool."""
    for shape in shapes:
        args, static = _step_args(runner, shape)
        _, kv_cache, hidden = runner._run("step", runner._step, (runner.params, kv_cache), args, **static)
        # Prompt logprobs: one scorer per step token count (a 1-token prompt chunk, cut by the
        # token budget, rides in a decode-shaped step).
        _run_reader(runner, hidden, shape.tokens, sequence_parallel=False)
    for args, filters in _multi_steps(runner, shapes):
        kv_cache = runner._run("multi_step", runner._multi_step, (runner.params, kv_cache), args,
                               steps=runner.ecfg.decode_steps, filters=filters)[1]
    return kv_cache


def _lowering(name: str, fn, fixed: tuple, args: tuple, **static):
    """(runner._run's key, a function lowering the call) for fn(*fixed, *args, **static)."""
    return key(name, args, **static), functools.partial(lower, fn, *fixed, *args, **static)


def _step_args(runner, shape: StepShape) -> tuple[tuple, dict]:
    """The step's arrays for an empty batch of `shape` (the latest sampled tokens: zeros, as the
    runner starts with; not the runner's own, which serving may be replacing), its static arguments."""
    return (step_arrays(shape, runner.max_pages_per_seq, runner.num_pages * runner.page_size,
                        runner.no_sampled_tokens(), _lora_weights(runner), runner.table_groups),
            dict(num_prefill_rows=shape.prefill_rows, max_q=shape.max_q, decode_q=shape.decode_q))


def _multi_steps(runner, shapes: list[StepShape]) -> list[tuple[tuple, bool | None]]:
    """The multi-step decode's (arrays, filters) for each decode shape of `shapes` and compiled
    variant (step.multi_step_variants; none when decode_steps is 1)."""
    if runner.ecfg.decode_steps == 1:
        return []
    return [(multi_step_arrays(s, runner.max_pages_per_seq, runner.num_pages * runner.page_size,
                               runner.no_sampled_tokens(), runner.no_sampled_tokens(runner.ecfg.decode_steps),
                               runner.max_model_len, runner.cfg.vocab_size, penalties, _lora_weights(runner),
                               runner.table_groups),
             filters)
            for s in shapes if s.plain_decode for penalties, filters in multi_step_variants(parallel.platform(runner.mesh))]


def _reader_lowering(runner, hidden, index, sequence_parallel: bool):
    """(key, lowering) of what reads a step's hidden states (a sequence-parallel prefill's: split
    over "seq", executables of their own, named as ModelRunner._pool and _prompt_logprobs name
    them): an embedding engine's pooling sums, else the prompt-logprobs scorer."""
    prefix = "sequence_parallel_" if sequence_parallel else ""
    if runner.pools:
        return _lowering(prefix + "pool", runner._pooler, (), (hidden, index, index))
    return _lowering(prefix + "prompt_logprobs", runner._scorer, (runner.params,), (hidden, index, index))


def _run_reader(runner, hidden, tokens: int, sequence_parallel: bool) -> None:
    """Run that reader once over `hidden`, reading no row."""
    empty = np.zeros(tokens, np.int32)
    read = runner._pool if runner.pools else runner._prompt_logprobs
    jax.block_until_ready(read(hidden, empty, empty, sequence_parallel=sequence_parallel))


def _sequence_parallel_args(runner, tokens: int) -> tuple:
    """A sequence-parallel prefill's arrays for `tokens` tokens, writing nothing."""
    return empty_sequence_parallel_prefill(tokens, runner.max_pages_per_seq, runner.table_groups, _lora_weights(runner))


def _lora_weights(runner):
    """The LoRA adapters' weights the steps take (None: no LoRA)."""
    return None if runner.lora is None else runner.lora.weights


def _outputs(executable):
    """An executable's outputs as ShapeDtypeStructs with their shardings."""
    return jax.tree.map(lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s),
                        executable.out_info, executable.output_shardings)
