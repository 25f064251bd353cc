"""The Prometheus metrics of one app (`/metrics`): HTTP requests by route and status and their duration (recorded by
`app.py`'s middleware), and per engine step the batch size, step time, accepted lengths, D-Cut's budget and pruned
tokens, and where streamed tokens came from (recorded by the worker thread)."""

from __future__ import annotations


class ServingMetrics:
    """The Prometheus metrics of one app, in its own `CollectorRegistry` (so several apps in one process, as in the
    tests, do not collide). HTTP metrics are recorded by the server, step metrics by the worker thread."""

    def __init__(self, worker_gauges=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("angelspec_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.request_duration = Histogram(
            "angelspec_request_duration_seconds", "time from request to the last byte of the response", ["route"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.queue_size = Gauge("angelspec_queue_size", "requests submitted and not yet running", registry=r)
        self.running = Gauge("angelspec_running_requests", "requests in the running batch", registry=r)
        self.batch_size = Histogram("angelspec_batch_size", "requests advanced per engine step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.step_duration = Histogram("angelspec_step_duration_seconds", "one engine step (draft + verify)",
                                       buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.accepted_length = Histogram(
            "angelspec_accepted_length", "tokens a request gained in one step (bonus token included)",
            buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32), registry=r)
        self.verify_budget = Histogram("angelspec_verify_budget", "draft tokens verified in one step (D-Cut budget)",
                                       buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.pruned_tokens = Histogram("angelspec_pruned_draft_tokens", "draft tokens pruned (not verified) per step",
                                       buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.cost_model_choice = Counter("angelspec_cost_model_choice", "steps by the cost model's choice",
                                         ["choice"], registry=r)
        self.generated_tokens = Counter("angelspec_generated_tokens", "tokens streamed, by who proposed them",
                                        ["source"], registry=r)
        self._last_trace = None

    def bind(self, worker) -> None:
        """Gauges read at scrape time from `worker` (an `EngineWorker`)."""
        self.queue_size.set_function(lambda: worker.queue_size)
        self.running.set_function(lambda: worker.engine.num_running)

    def observe_step(self, engine, events, seconds: float) -> None:
        self.step_duration.observe(seconds)
        advanced = [e for e in events if e.token_ids]
        if advanced:
            self.batch_size.observe(len(advanced))
        for event in advanced:
            self.accepted_length.observe(len(event.token_ids))
            drafted = sum(event.from_draft)
            self.generated_tokens.labels("draft").inc(drafted)
            self.generated_tokens.labels("target").inc(len(event.token_ids) - drafted)
        trace = engine.last_step
        if trace is None or trace is self._last_trace:  # a step that only dropped cancelled requests has no trace
            return
        self._last_trace = trace
        self.verify_budget.observe(trace.budget)
        self.pruned_tokens.observe(trace.pruned_tokens)
        self.cost_model_choice.labels(trace.choice).inc()
