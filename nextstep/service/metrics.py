"""Prometheus metrics of the service (one registry per app, so tests and reloads do not collide)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("nextstep_requests_total", "HTTP requests by route, model and status",
                                ["route", "model", "status"], registry=r)
        self.request_seconds = Histogram("nextstep_request_seconds", "HTTP request latency", ["route"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.inference_seconds = Histogram("nextstep_inference_seconds", "ONNX Runtime call latency",
                                           ["model", "graph"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_rows = Histogram("nextstep_microbatch_rows", "rows per ONNX Runtime call", ["model", "graph"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.store_seconds = Histogram("nextstep_state_store_seconds", "state store operation latency",
                                       ["operation"], buckets=LATENCY_BUCKETS, registry=r)
        self.cas_retries = Counter("nextstep_cas_retries_total", "compare-and-set conflicts that were retried",
                                   ["model"], registry=r)
        self.models_loaded = Gauge("nextstep_models_loaded", "model versions loaded", registry=r)
        self.in_flight = Gauge("nextstep_requests_in_flight", "requests being served", registry=r)

    def on_batch(self, model_name: str, graph: str, rows: int, seconds: float) -> None:
        self.inference_seconds.labels(model_name, graph).observe(seconds)
        self.batch_rows.labels(model_name, graph).observe(rows)
