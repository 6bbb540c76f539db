"""Prometheus metrics of the service (one registry per app, so tests and reloads do not collide).

Every label value comes from a bounded set, so no client can grow the scrape: `route` is a route template
(or "unmatched"), `model` the name of a model this process has loaded (any other name, e.g. the one in a
404's path, is ""; a pinned `name@version` counts under its name), `status` an HTTP status, `graph` and
`operation` names from the code. The refused-artifact gauge's `model` and `version` are directory names under
the artifacts directory (the operator's, not a client's)."""

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
        self.unknown_ids = Counter("nextstep_unknown_ids_total", "question or item ids the version never saw, "
                                   "answered through its unknown row (events stepped, questions predicted or ranked)",
                                   ["model", "version", "task"], registry=r)
        self.models_loaded = Gauge("nextstep_models_loaded", "model versions loaded", registry=r)
        self.artifacts_refused = Gauge("nextstep_artifacts_refused", "artifact directories the last (re)load "
                                       "refused (1 each); kept=true: that version keeps serving the object "
                                       "loaded before", ["model", "version", "kept"], registry=r)
        self.reloads = Counter("nextstep_reloads_total", "reloads by outcome (ok: nothing refused): POST "
                               "/v1/models/reload, and those run when another replica's reload moved the generation",
                               ["outcome"], registry=r)
        live = ["model", "version", "role"]
        self.live_scored = Counter("nextstep_live_scored_total", "events whose prediction was scored when they came "
                                   "(live quality, quality.py)", live, registry=r)
        self.live_log_loss = Counter("nextstep_live_log_loss_total", "sum of the scored events' log loss", live,
                                     registry=r)
        self.live_brier = Counter("nextstep_live_brier_total", "sum of the scored events' Brier score", live,
                                  registry=r)
        self.live_buckets = Counter("nextstep_live_predictions_total", "scored events by predicted P(full credit) "
                                    "(bucket: its tenth, 0-9) and whether it was full credit (outcome 1/0)",
                                    [*live, "bucket", "outcome"], registry=r)
        self.live_reciprocal_rank = Counter("nextstep_live_reciprocal_rank_total", "sessions: sum of the clicked "
                                            "items' reciprocal ranks in the list recommended before each click",
                                            live, registry=r)
        self.live_hits = Counter("nextstep_live_hits_total", "sessions: clicks on an item ranked within the first k "
                                 "(k: 1, 5, 10, 20) of the list recommended before", [*live, "k"], registry=r)
        self.live_unscored = Counter("nextstep_live_unscored_total", "requests whose events went unscored: the "
                                     "live-quality scoring queue was full", ["model"], registry=r)
        self.shadow = Counter("nextstep_shadow_total", "shadow turns by model and outcome (done; dropped: the queue "
                              "was full; failed)", ["model", "outcome"], registry=r)
        self.srs_refits = Counter("nextstep_srs_refits_total", "flashcard users' turns at the service's FSRS-6 "
                                  "refit worker, by model and outcome (done; skipped: another worker held the user's "
                                  "lease; not_due: nothing new to fit by their turn; dropped: the queue was full; "
                                  "failed)", ["model", "outcome"], registry=r)
        self.in_flight = Gauge("nextstep_requests_in_flight", "requests being served", registry=r)
        self.gate = Gauge("nextstep_gate", "a gated shadow's evidence (gate.py): paired events, mean loss difference "
                          "(candidate minus serving, nats) and its confidence sequence's bounds", ["model", "stat"],
                          registry=r)
        self.serving = 0  # requests being served: read by the gauge when scraped, no lock per request
        self.in_flight.set_function(lambda: self.serving)
        # labelled children, looked up once per label set (labels() costs a lock and a dict lookup per call)
        self._request_children: dict[tuple, tuple] = {}
        self._batch_children: dict[tuple, tuple] = {}
        self._live_children: dict[tuple, object] = {}
        self._models: frozenset[str] = frozenset()  # names a `model` label may take

    def set_models(self, models) -> None:
        """The loaded models (at startup and each reload): their names are the only values `model` takes."""
        self._models = frozenset(m.name for m in models)
        self.models_loaded.set(len(models))

    def set_refused(self, refused) -> None:
        """The last load's refusals (registry.Refusal): the gauge holds exactly these."""
        self.artifacts_refused.clear()
        for r in refused:
            self.artifacts_refused.labels(r.model, r.version, "true" if r.kept else "false").set(1)

    def request_done(self, route: str, model: str, status: int, seconds: float) -> None:
        """One request answered: `route` a template, `model` the path's model name ("" unless loaded)."""
        if model not in self._models:
            model = model.partition("@")[0]  # name@version: a pinned request
            if model not in self._models:
                model = ""
        children = self._request_children.get((route, model, status))
        if children is None:
            children = self._request_children[(route, model, status)] = (
                self.requests.labels(route, model, str(status)), self.request_seconds.labels(route))
        children[0].inc()
        children[1].observe(seconds)

    def on_gate(self, model: str, evidence) -> None:
        """A gated shadow's evidence after its latest events (gate.Evidence)."""
        self.gate.labels(model, "events").set(evidence.n)
        if evidence.mean is not None:
            self.gate.labels(model, "mean").set(evidence.mean)
        if evidence.interval is not None:
            self.gate.labels(model, "low").set(evidence.interval[0])
            self.gate.labels(model, "high").set(evidence.interval[1])

    def on_live_scores(self, key: tuple[str, str, str], fields: dict[str, float]) -> None:
        """A batch of live scores (quality.fields_of: n, ll, br and per fine bucket p<b> / q<b>; ranking_fields:
        n, rr, h<k>). Each labelled child is looked up once (this runs on every request)."""
        children = self._live_children
        for name, value in fields.items():
            child = children.get((key, name))
            if child is None:
                child = children[(key, name)] = self._live_child(key, name)
            child.inc(value)

    def _live_child(self, key: tuple[str, str, str], name: str):
        from .quality import BINS

        if name == "n":
            return self.live_scored.labels(*key)
        if name in ("ll", "br", "rr"):
            return {"ll": self.live_log_loss, "br": self.live_brier, "rr": self.live_reciprocal_rank}[name].labels(*key)
        if name[0] == "h":
            return self.live_hits.labels(*key, name[1:])
        tenth = str(min(9, int(name[1:]) * 10 // BINS))
        return self.live_buckets.labels(*key, tenth, "1" if name[0] == "p" else "0")

    def on_unknown(self, model, count: int) -> None:
        """`count` ids a loaded model (registry.LoadedModel) answered through its unknown row."""
        self.unknown_ids.labels(model.name, model.version, model.task).inc(count)

    def on_batch(self, model_name: str, graph: str, rows: int, seconds: float) -> None:
        children = self._batch_children.get((model_name, graph))
        if children is None:
            children = self._batch_children[(model_name, graph)] = (
                self.inference_seconds.labels(model_name, graph), self.batch_rows.labels(model_name, graph))
        children[0].observe(seconds)
        children[1].observe(rows)
