"""Prometheus metrics of one server, in its own CollectorRegistry (several servers in one process
do not clash).

Request latencies are observed by the frontend as each request's deltas arrive; engine state
(queues, KV pages, prefix cache, token and preemption counts) is read at scrape time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.compilations import CompileCounter

if TYPE_CHECKING:
    from jaxserve.engine import LLMEngine, RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.4, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.engines: "list[LLMEngine]" = []     # set once loaded: one per data-parallel replica
        self.roofline = None                       # a jaxserve.roofline.RooflineMeter, set once loaded
        r = self.registry
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("jaxserve_inter_token_latency_seconds",
                                     "Time between consecutive token deltas of a request.",
                                     buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("jaxserve_request_queue_time_seconds", "Arrival to first scheduled step.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.success = Counter("jaxserve_request_success", "Finished requests by finish reason.",
                               ["finish_reason"], registry=r)
        r.register(_EngineCollector(self))

    def observe_finished(self, out: "RequestOutput") -> None:
        reasons = [c.finish_reason for c in out.outputs if c.finish_reason not in (None, "abort")]
        if not reasons:   # aborted
            return
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
        if out.first_scheduled_time is not None:
            self.queue_time.observe(out.first_scheduled_time - out.arrival_time)
        self.e2e.observe(out.finish_time - out.arrival_time)
        self.success.labels(finish_reason=reasons[-1]).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        engines = self.metrics.engines
        if not engines:
            return
        scheds = [e.scheduler for e in engines]

        def mean(values):   # replicas have equal KV pools
            return sum(values) / len(engines)

        yield GaugeMetricFamily("jaxserve_num_sequences_running", "Sequences in the running batch.",
                                value=sum(s.num_running for s in scheds))
        yield GaugeMetricFamily("jaxserve_num_sequences_waiting", "Sequences waiting to be scheduled.",
                                value=sum(s.num_waiting for s in scheds))
        yield GaugeMetricFamily("jaxserve_kv_cache_usage_ratio",
                                "Share of KV pages held by sequences (prefix-cached pages count as free).",
                                value=mean(s.page_usage for s in scheds))
        yield GaugeMetricFamily("jaxserve_kv_free_pages",
                                "KV pages free to allocate (prefix-cached ones included), all replicas.",
                                value=sum(e.block_manager.num_free_pages for e in engines))
        yield GaugeMetricFamily("jaxserve_prefix_cache_hit_rate",
                                "Share of queried prompt tokens found in the prefix cache (replica mean).",
                                value=mean(s.prefix_hit_rate for s in scheds))
        yield CounterMetricFamily("jaxserve_prompt_tokens", "Prompt tokens accepted.",
                                  value=sum(e.stats["prompt_tokens"] for e in engines))
        yield CounterMetricFamily("jaxserve_generation_tokens", "Tokens generated.",
                                  value=sum(e.stats["generation_tokens"] for e in engines))
        yield CounterMetricFamily("jaxserve_failed_steps", "Engine steps that raised (their requests failed).",
                                  value=sum(e.stats["failed_steps"] for e in engines))
        for key, help_text in (("spec_verify_rows", "Speculative decoding: rows that verified proposals."),
                               ("spec_proposed_tokens", "Speculative decoding: proposed tokens verified."),
                               ("spec_accepted_tokens", "Speculative decoding: proposed tokens accepted."),
                               ("spec_draft_steps", "Speculative decoding: steps of the draft model."),
                               ("spec_off_steps", "Speculative decoding: steps run without it (it would not pay)."),
                               ("multi_step_decodes", "Steps that ran decode_steps decode steps in one program.")):
            yield CounterMetricFamily(f"jaxserve_{key}", help_text, value=sum(e.stats[key] for e in engines))
        yield CounterMetricFamily("jaxserve_num_preemptions", "Sequences preempted (recomputed later).",
                                  value=sum(s.num_preemptions for s in scheds))
        yield CounterMetricFamily("jaxserve_xla_compilations",
                                  "XLA compilations in this process (flat once warm-up has finished; the "
                                  "serving thread never compiles).", value=CompileCounter.count)
        yield GaugeMetricFamily("jaxserve_warmup_pending_step_shapes",
                                "Step shapes warm-up still builds in the background (their batches pad up "
                                "into larger ones meanwhile), all replicas.",
                                value=sum(e.runner.background_warmup.pending for e in engines
                                          if e.runner.background_warmup is not None))
        if self.metrics.roofline is not None:
            yield from self.metrics.roofline.metric_families()
