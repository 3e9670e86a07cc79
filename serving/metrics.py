"""Prometheus metrics of the gRPC server, served over HTTP (`/metrics`).

Latencies and counts are recorded by the server as requests run; the engine's state (running and
waiting sequences, KV pages, prefix hits) is read from `Engine.stats()` when scraped, so nothing
polls the engine between scrapes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "pallasite_"
TTFT_BUCKETS = (.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (.001, .0025, .005, .0075, .01, .015, .02, .025, .03, .04, .05, .075, .1, .2, .5, 1)
E2E_BUCKETS = (.05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        # A registry of its own, so that several servers (tests) can live in one process.
        self.registry = r = registry or CollectorRegistry()
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "From receiving a request to its first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive tokens of a request", buckets=ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram(PREFIX + "request_latency_seconds",
                             "From receiving a request to its last token", buckets=E2E_BUCKETS,
                             registry=r)
        self.queue_time = Histogram(PREFIX + "queue_time_seconds",
                                    "From receiving a request to the engine taking it up",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.queue_depth = Gauge(PREFIX + "queue_depth",
                                 "Admitted requests that have no first token yet", registry=r)
        self.in_flight = Gauge(PREFIX + "requests_in_flight", "Generate calls under way",
                               registry=r)
        self.requests = Counter(PREFIX + "requests", "Finished calls by method and status code",
                                ["method", "code"], registry=r)
        self.errors = Counter(PREFIX + "request_errors", "Calls that ended in an error, by code",
                              ["code"], registry=r)
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "Tokens generated",
                                        registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=r)
        self.engine_collector = None

    def watch_engine(self, engine):
        """Export the engine's gauges and counters, read at each scrape."""
        self.engine_collector = _EngineCollector(engine)
        self.registry.register(self.engine_collector)

    def finished(self, method: str, code: str):
        self.requests.labels(method, code).inc()
        if code != "OK":
            self.errors.labels(code).inc()

    def serve_http(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics on `port` (0: any free port); returns the port."""
        httpd, _ = start_http_server(port, addr=addr, registry=self.registry)
        self.httpd = httpd
        return httpd.server_port

    def close(self):
        if getattr(self, "httpd", None) is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


class _EngineCollector:
    # (key of Engine.stats(), metric name, help)
    GAUGES = [("running", "running_sequences", "Sequences being generated"),
              ("waiting", "waiting_requests", "Requests waiting in the engine's scheduler"),
              ("pages_used", "kv_pages_used", "KV pages held by running sequences"),
              ("pages_cached", "kv_pages_cached", "KV pages kept in the prefix cache"),
              ("pages_free", "kv_pages_free", "KV pages free"),
              ("pages_total", "kv_pages_total", "KV pages in the pool"),
              ("spec_mean_accepted", "spec_mean_accepted_length",
               "Tokens emitted per speculating sequence-step (accepted proposals + 1)")]
    COUNTERS = [("prefix_hit_tokens", "prefix_hit_tokens", "Prompt tokens found in the prefix cache"),
                ("preemptions", "preemptions", "Sequences preempted for lack of KV pages"),
                ("window_pages_freed", "kv_window_pages_freed",
                 "KV pages given back early because every layer's sliding window had passed them"),
                ("compilations", "compilations", "Compilations of the engine step"),
                ("spec_proposed_tokens", "spec_proposed_tokens",
                 "Speculative tokens proposed (0 without speculative decoding)"),
                ("spec_accepted_tokens", "spec_accepted_tokens", "Speculative tokens accepted"),
                ("spec_verify_steps", "spec_verify_steps",
                 "Sequence-steps that verified at least one proposed token")]

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        # Read from the scrape thread while the engine steps: each value is one int, read whole.
        stats = self.engine.stats()
        info = GaugeMetricFamily(PREFIX + "kv_cache_info", "The KV cache pages' dtype",
                                 labels=["dtype"])
        info.add_metric([str(self.engine.kv_cache_dtype)], 1)
        yield info
        for key, name, doc in self.GAUGES:
            if key in stats:
                yield GaugeMetricFamily(PREFIX + name, doc, value=stats[key])
        for key, name, doc in self.COUNTERS:
            if key in stats:
                yield CounterMetricFamily(PREFIX + name, doc, value=stats[key])
