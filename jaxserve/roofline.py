"""Roofline accounting of engine steps: the bytes a step must move (weights + the live KV of its
batch) and the FLOPs it must do, as shares of the device's peaks: MBU (model bandwidth
utilization) and MFU (model FLOPs utilization).

Peaks: datasheet figures for known GPUs and TPUs. On any other device (CPU) both are measured
here: read bandwidth with a jitted reduction over a buffer far larger than the caches, FLOP/s
with a square matmul; the best of a few runs.
"""
from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig

# device_kind substring: (dense bf16 FLOP/s, memory bytes/s), from the vendors' datasheets.
DATASHEET_PEAKS = {
    "H200": (989e12, 4.8e12),
    "H100": (989e12, 3.35e12),        # SXM; PCIe is 756 TFLOP/s, 2.0 TB/s
    "TPU v5 lite": (197e12, 819e9),   # v5e
    "TPU v5e": (197e12, 819e9),
    "TPU v6 lite": (918e12, 1640e9),  # v6e
    "TPU v6e": (918e12, 1640e9),
}


@dataclasses.dataclass(frozen=True)
class Peaks:
    flops: float        # FLOP/s
    bandwidth: float    # bytes/s
    source: str


def device_peaks(measure_bytes: int = 256 << 20, matmul_n: int = 1024) -> Peaks:
    """Datasheet peaks of a known device, else measured ones (the server measures small, once at
    start-up; the benchmarks measure 1 GiB and 2048^2 in each run)."""
    kind = jax.devices()[0].device_kind
    for key, (flops, bandwidth) in DATASHEET_PEAKS.items():
        if key in kind:
            return Peaks(flops, bandwidth, f"datasheet ({kind})")
    return Peaks(measure_matmul_flops(matmul_n), measure_read_bandwidth(measure_bytes),
                 f"measured ({kind}: {measure_bytes / 2**20:.0f} MiB read, {matmul_n}^2 float32 matmul)")


def best_seconds(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def measure_read_bandwidth(nbytes: int = 1 << 30, iters: int = 5) -> float:
    """Bytes/s of a jitted sum over a float32 buffer of `nbytes` (XLA spreads it over all cores)."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    seconds = best_seconds(jax.jit(jnp.sum), x, iters=iters)
    del x
    return nbytes / seconds


def measure_matmul_flops(n: int, iters: int = 5) -> float:
    a = jnp.ones((n, n), jnp.float32)
    return 2 * n**3 / best_seconds(jax.jit(jnp.matmul), a, a, iters=iters)


@dataclasses.dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float

    def seconds(self, peaks: Peaks) -> float:
        """The step's time at the roofline: limited by compute or by memory, whichever takes longer."""
        return max(self.flops / peaks.flops, self.bytes / peaks.bandwidth)


class CostModel:
    """Ideal FLOPs and bytes of one step: every weight read once, every attended K/V entry read
    once, new K/V written once; activations left out."""

    def __init__(self, cfg: ModelConfig, itemsize: int):
        h, d, n = cfg.hidden_size, cfg.head_dim, cfg.num_params
        self.cfg = cfg
        self.head_params = cfg.vocab_size * h
        # Every weight besides the embedding table(s) multiplies each new token once (norm scales
        # and biases are counted as if they did: a rounding error), but the experts it is not routed to.
        self.token_params = cfg.num_active_params - self.head_params * (1 if cfg.tie_word_embeddings else 2)
        # An untied embedding table is only gathered from (a few rows); the LM head is read in full,
        # and every expert (a batch's tokens route to most of them).
        read_params = n - (0 if cfg.tie_word_embeddings else self.head_params)
        self.weight_bytes = read_params * itemsize
        self.kv_bytes_per_token = cfg.kv_pools * cfg.num_kv_heads * d * itemsize    # K (and V), one layer
        self.layers_by_window = collections.Counter(cfg.sliding_windows)

    def step(self, rows: list[tuple[int, int, int]]) -> StepCost:
        """rows: (query tokens, KV length after the step, tokens sampled) for each sequence."""
        c = self.cfg
        # numpy over the rows, layers grouped by window: the speculation throttle asks every step
        n, kv, sampled = np.asarray(rows, np.int64).reshape(-1, 3).T
        flops = 2 * int(n.sum()) * self.token_params + 2 * int(sampled.sum()) * self.head_params
        nbytes = self.weight_bytes
        for window, layers in self.layers_by_window.items():
            flops += layers * 4 * c.num_heads * c.head_dim * int(_attended(n, kv, window).sum())
            keys = kv if window is None else np.minimum(kv, window)
            nbytes += layers * int((keys + n).sum()) * self.kv_bytes_per_token
        return StepCost(flops, nbytes)


def _attended(n, kv, window: int | None):
    """Query-key pairs of n new causal queries ending at position kv (sum of min(i, window));
    n and kv: ints or arrays of them."""
    first = kv - n + 1
    full = (first + kv) * n // 2
    if window is None:
        return full
    below = np.maximum(0, np.minimum(kv, window) - first + 1)     # queries at i <= window see i keys
    return np.where(window >= kv, full, (first + first + below - 1) * below // 2 + (n - below) * window)


def schedule_rows(scheduler_output, step: int = 0) -> list[tuple[int, int, int]]:
    """CostModel rows of a SchedulerOutput's device step `step` (a multi-step decode runs
    decode_steps of them), read after the step ran (num_computed_tokens advanced)."""
    return [(s.num_query_tokens, s.seq.num_computed_tokens - (s.num_steps - 1 - step), s.num_sampled)
            for s in scheduler_output.scheduled if s.num_steps > step]


class RooflineMeter:
    """MBU / MFU over the engine's last `window` steps. `on_step` is an EngineThread step
    listener; it reads the schedule of the step that just ran from `engine.last_schedule`."""

    def __init__(self, engine, peaks: Peaks, window: int = 64):
        self.engine = engine
        self.peaks = peaks
        self.cost = CostModel(engine.model_cfg, jnp.dtype(engine.dtype).itemsize)
        self._steps: collections.deque = collections.deque(maxlen=window)   # (StepCost, seconds)

    def on_step(self, outputs, seconds: float) -> None:
        schedule = self.engine.last_schedule
        if schedule is not None and schedule.scheduled:
            costs = [self.cost.step(schedule_rows(schedule, k)) for k in range(schedule.decode_steps)]
            self._steps.append((StepCost(sum(c.flops for c in costs), sum(c.bytes for c in costs)), seconds))

    def utilization(self) -> tuple[float, float]:
        """(MBU, MFU) of the recent steps; zeros before the first."""
        steps = list(self._steps)
        seconds = sum(t for _, t in steps)
        if not seconds:
            return 0.0, 0.0
        return (sum(c.bytes for c, _ in steps) / seconds / self.peaks.bandwidth,
                sum(c.flops for c, _ in steps) / seconds / self.peaks.flops)

    def metric_families(self):
        """Prometheus gauges, for a custom collector's collect()."""
        from prometheus_client.core import GaugeMetricFamily

        mbu, mfu = self.utilization()
        yield GaugeMetricFamily("jaxserve_model_bandwidth_utilization",
                                "Ideal bytes moved (weights + live KV) / step time / peak bandwidth, "
                                "over the last steps.", value=mbu)
        yield GaugeMetricFamily("jaxserve_model_flops_utilization",
                                "Model FLOPs / step time / peak FLOP/s, over the last steps.", value=mfu)
        yield GaugeMetricFamily("jaxserve_peak_memory_bandwidth_bytes_per_second",
                                f"Peak used for MBU: {self.peaks.source}.", value=self.peaks.bandwidth)
        yield GaugeMetricFamily("jaxserve_peak_flops_per_second",
                                f"Peak used for MFU: {self.peaks.source}.", value=self.peaks.flops)
