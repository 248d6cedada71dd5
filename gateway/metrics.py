"""The gateway's own metrics, on its `/metrics` (Prometheus' conventions, like backend/metrics.py).

One registry per gateway app (not prometheus_client's global one), so several apps in one process
(tests) do not collide. Every `status` a caller can get exists at 0 from start-up.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REQUESTS = "tandem_gateway_requests_total"
FIRST_AUDIO = "tandem_gateway_first_audio_seconds"
STREAMS = "tandem_gateway_streams"
CONNECTIONS = "tandem_gateway_connections"
CUT = "tandem_gateway_connections_cut_total"
NAMES = (REQUESTS, FIRST_AUDIO, STREAMS, CONNECTIONS, CUT)
# Why the HTTP server refused or closed a connection (gateway/serve.py).
CUT_REASONS = ("cap", "client_cap", "header_timeout", "body_timeout", "drain")
STATUSES = ("200", "400", "404", "405", "409", "413", "499", "500", "503")
# The `model` label: a served model's name, or NO_MODEL for a request that named none the gateway
# serves (a refused body, another route): never a caller's own string, so the series stay bounded.
NO_MODEL = "-"

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            REQUESTS.removesuffix("_total"),
            "Requests answered, by HTTP status (499: the caller hung up mid-stream) and model",
            ["status", "model"],
            registry=self.registry,
        )
        self.first_audio = Histogram(
            FIRST_AUDIO,
            "Request received to its first audio bytes handed to the HTTP server, by model",
            ["model"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.streams = Gauge(
            STREAMS, "Speech responses streaming now, by model", ["model"], registry=self.registry
        )
        self.serve(NO_MODEL)
        self.connections = Gauge(CONNECTIONS, "HTTP connections open (admitted)", registry=self.registry)
        self.cut = Counter(
            CUT.removesuffix("_total"),
            "Connections the HTTP server refused (cap: over the connection cap, client_cap: over the"
            " cap per client address) or closed (a read timeout; drain: a refused body still arriving)",
            ["reason"],
            registry=self.registry,
        )
        for reason in CUT_REASONS:
            self.cut.labels(reason=reason)

    def serve(self, model: str) -> None:
        """Every series of `model` at 0 (the gateway calls it for each model it serves)."""
        for status in STATUSES:
            self.requests.labels(status=status, model=model)
        if model != NO_MODEL:
            self.first_audio.labels(model=model)
            self.streams.labels(model=model)

    def count(self, status: int, model: str = NO_MODEL) -> None:
        """One request answered with `status` (a refusal, or a stream's end)."""
        self.requests.labels(status=str(status), model=model).inc()
