"""Prometheus metrics, named as vLLM names them where the meaning is the same (prefix `atlas:`).

Each app gets its own CollectorRegistry, so tests can build many apps in one process. Engine-side numbers
(queue lengths, KV usage, token and event totals) are read from the engine loop's latest stats snapshot at
scrape time; latencies are observed by the engine loop as outputs are produced.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from atlas.engine.outputs import FinishReason
from atlas.server.engine_loop import EngineLoop

# vLLM's buckets, so dashboards built for it read ours the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)

# (metric, help, EngineStats attribute)
_GAUGES = (
    ("atlas:num_requests_running", "Requests in the running batch.", "num_running"),
    ("atlas:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("atlas:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.", "kv_usage"),
    ("atlas:kv_blocks_used", "KV blocks owned by live sequences.", "kv_blocks_used"),
    ("atlas:kv_blocks_total", "KV blocks in the pool.", "kv_blocks_total"),
    ("atlas:engine_step", "Scheduler steps taken.", "step"),
    ("atlas:spec_decode_draft_choice", "Drafts the last step verified per sequence (the draft-count policy's choice, "
     "0..--num-drafts).", "spec_draft_choice"),
    ("atlas:spec_decode_tokens_per_verify", "Tokens emitted per verify step (accepted drafts + 1).",
     "spec_tokens_per_verify"),
    ("atlas:drafter_coverage_warm", "MTP drafter rows / prompt length when a warm (prefix-hit) turn's prefill "
     "completes.", "drafter_coverage_warm"),
    ("atlas:drafter_coverage_cold", "MTP drafter rows / prompt length when a cold turn's prefill completes.",
     "drafter_coverage_cold"),
)
_COUNTERS = (
    ("atlas:prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens_total"),
    ("atlas:generation_tokens", "Generated tokens.", "generation_tokens_total"),
    ("atlas:invariant_checks", "State-machine invariant checks passed.", "invariant_checks"),
    ("atlas:trace_events_written", "Events committed to the trace store (on disk).", "trace_events_written"),
    ("atlas:num_preemptions", "Sequences preempted for KV blocks.", "preemptions_total"),
    ("atlas:num_rollbacks", "Content loops rolled back to a ring snapshot.", "rollbacks_total"),
    ("atlas:num_rollback_declines", "Content loops whose rollback declined (the request ended with stop).",
     "rollback_declines_total"),
    ("atlas:spec_decode_num_verify_steps", "Speculative verify steps.", "spec_verify_steps"),
    ("atlas:spec_decode_num_draft_tokens", "Draft tokens verified.", "spec_drafts_proposed"),
    ("atlas:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_drafts_accepted"),
    ("atlas:spec_decode_num_latched_off", "Sequences whose speculative lane latched off at the QSA inert bound.",
     "spec_latched_off_total"),
    ("atlas:prefix_cache_queries", "Admissions looked up in the prefix cache.", "prefix_cache_queries"),
    ("atlas:prefix_cache_hits", "Admissions that resumed from the prefix cache.", "prefix_cache_hits"),
    ("atlas:prefix_cache_tokens_saved", "Prefill tokens skipped by prefix-cache hits.", "prefix_tokens_saved"),
    ("atlas:drafter_carry_adopted", "Warm turns that kept the carried MTP drafter rows.", "carry_adopted_total"),
)


# (metric, help, attribute of the connection registry in atlas.server.connections), counters unless open
_CONNECTIONS = (
    ("atlas:http_connections_open", "Open HTTP connections.", "open"),
    ("atlas:http_connections_refused", "Connections refused with 503 at the connection cap.", "refused"),
    ("atlas:http_header_timeouts", "Connections closed because a request's headers did not arrive in time.",
     "header_timeouts"),
)


class _ServerCollector:
    """HTTP-side numbers: connections (once a server runs the app) and requests in flight."""

    def __init__(self, lifecycle: Any, model_name: str) -> None:
        self._lifecycle = lifecycle
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily("atlas:http_requests_in_flight", "Requests inside the app.",
                                     labels=["model_name"])
        inflight.add_metric([self._model], float(self._lifecycle.in_flight.value))
        yield inflight
        registry = self._lifecycle.connections
        if registry is None:
            return
        for name, doc, attr in _CONNECTIONS:
            family = GaugeMetricFamily if attr == "open" else CounterMetricFamily
            m = family(name, doc, labels=["model_name"])
            m.add_metric([self._model], float(getattr(registry, attr)))
            yield m


class _EngineStatsCollector:
    def __init__(self, engine_loop: EngineLoop, model_name: str) -> None:
        self._loop = engine_loop
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._loop.latest_stats
        dead = GaugeMetricFamily("atlas:engine_dead", "1 once the engine hit a fatal fault.", labels=["model_name"])
        dead.add_metric([self._model], 1.0 if self._loop.dead else 0.0)
        yield dead
        if stats is None:
            return
        for name, doc, attr in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(getattr(stats, attr, 0) or 0))
            yield g
        for name, doc, attr in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], float(getattr(stats, attr, 0) or 0))
            yield c
        # per draft position: unconditional (each row's own verdict) and conditional (all earlier accepted)
        rate = GaugeMetricFamily("atlas:spec_decode_acceptance_rate", "Draft acceptance rate by position.",
                                 labels=["model_name", "position", "kind"])
        for kind in ("unconditional", "conditional"):
            for i, p in enumerate(getattr(stats, f"spec_acceptance_{kind}", ()) or ()):
                rate.add_metric([self._model, str(i + 1), kind], float(p))
        yield rate
        chosen = CounterMetricFamily("atlas:spec_decode_steps_by_drafts", "Steps by the drafts the policy chose.",
                                     labels=["model_name", "drafts"])
        for k, steps in enumerate(getattr(stats, "spec_steps_by_drafts", ()) or ()):
            chosen.add_metric([self._model, str(k)], float(steps))
        yield chosen


class ServerMetrics:
    """The app's registry; also the engine loop's LatencyObserver."""

    def __init__(self, engine_loop: EngineLoop, model_name: str, lifecycle: Any = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(
            "atlas:time_to_first_token_seconds", "Time to first token.", labels,
            registry=self.registry, buckets=TTFT_BUCKETS,
        ).labels(model_name)
        self.itl = Histogram(
            "atlas:inter_token_latency_seconds", "Time between two outputs of one request.", labels,
            registry=self.registry, buckets=ITL_BUCKETS,
        ).labels(model_name)
        self.e2e = Histogram(
            "atlas:e2e_request_latency_seconds", "Arrival to finish.", labels,
            registry=self.registry, buckets=E2E_BUCKETS,
        ).labels(model_name)
        self.request_success = Counter(
            "atlas:request_success", "Finished requests, by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in FinishReason:  # present from the start, so a scrape shows zeros, not absence
            self.request_success.labels(model_name, reason.value)
        self.registry.register(_EngineStatsCollector(engine_loop, model_name))
        if lifecycle is not None:
            self.registry.register(_ServerCollector(lifecycle, model_name))

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finished(self, reason: FinishReason | None, seconds: float) -> None:
        self.request_success.labels(self.model_name, reason.value if reason else "unknown").inc()
        self.e2e.observe(seconds)


def sample_value(registry: CollectorRegistry, name: str, labels: dict[str, Any] | None = None) -> float | None:
    """One sample's value (for tests and the bench), e.g. sample_value(r, "atlas:request_success_total", {...})."""
    return registry.get_sample_value(name, {k: str(v) for k, v in (labels or {}).items()})
