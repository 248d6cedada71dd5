"""D's metrics: the transfer counters as they happen, and the gauges every ~0.1 s.

Threads: `on_transfer_event` (the receiver's `on_event`) runs on any receiver thread and only appends
to a list. Everything else runs on D's engine thread: `account` turns that list and the receiver's
cumulative stats into counter increments (each published once), `publish` sets the gauges from a
`DecodeGauges` snapshot. The sink (`backend/metrics.py`) is safe from any thread; no lock of D's is
held while calling it. Failure: a metrics call that raises is an engine fault like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.backend.metrics import MetricsSink, PublishTimer
from tandem.transfer import ReceiverStats, TransferEvent

# ReceiverStats field -> `proof` label of tandem_kv_regions_released_total (docs/failure-semantics.md).
_PROOFS = {
    "released_by_ack": "abort_ack",
    "released_by_done": "done",
    "released_by_refusal": "refused",
    "released_by_restart": "instance_changed",
    "released_by_gone": "instance_gone",
    "released_by_drop": "receiver_drops",
}


@dataclass(frozen=True)
class DecodeGauges:
    """What D's gauges say at one moment (taken by the engine thread)."""

    device_busy_s: float  # cumulative device time of finished steps (published as a counter)
    eager: bool  # a CUDA-graph capture failed: every step runs eagerly
    inflight: int  # members: admitted and not gone
    queued: int  # requests waiting for admission
    free_pages: int
    held_pages: int  # quarantined receive memory, in pages
    draining: bool
    admittable: int
    path: str


class DecodeMetrics:
    def __init__(self, metrics: MetricsSink, path: str) -> None:
        self.sink = metrics
        self._timer = PublishTimer()
        self._events: list[TransferEvent] = []
        self._verified = {"ok": 0, "mismatch": 0}
        self._late_dropped = 0
        self._released = dict.fromkeys(_PROOFS, 0)
        self._busy_published = 0.0
        metrics.set("tandem_transfer_path_info", 1, path=path)

    def on_transfer_event(self, event: TransferEvent) -> None:
        """Any receiver thread, once per finished transfer."""
        self._events.append(event)  # list.append is atomic; drained on the engine thread

    def due(self) -> bool:
        """Engine thread: time to publish the gauges again."""
        return self._timer.due()

    def account(self, st: ReceiverStats) -> None:
        """Engine thread, every iteration: counters are published as events happen."""
        m = self.sink
        for result, total in (("ok", st.verify_ok), ("mismatch", st.verify_mismatch)):
            delta = total - self._verified[result]
            if delta:
                m.inc("tandem_kv_verifications_total", delta, result=result)
                self._verified[result] = total
        for field, proof in _PROOFS.items():
            delta = getattr(st, field) - self._released[field]
            if delta:
                m.inc("tandem_kv_regions_released_total", delta, proof=proof)
                self._released[field] = getattr(st, field)
        late = st.late_chunks_dropped - self._late_dropped
        if late > 0:
            m.inc("tandem_kv_late_chunks_dropped_total", late)
            self._late_dropped = st.late_chunks_dropped
        while self._events:
            e = self._events.pop(0)
            ok = e.state in ("VERIFIED", "RELEASED")
            m.inc("tandem_transfers_total", outcome="ok" if ok else "failed")
            if ok:
                m.observe("tandem_transfer_bytes", e.nbytes)
                if e.verified_ns and e.request_sent_ns:
                    m.observe("tandem_transfer_latency_seconds", (e.verified_ns - e.request_sent_ns) / 1e9)

    def publish(self, g: DecodeGauges) -> None:
        """Engine thread, when `due`: the gauges (each update is a round trip to Triton)."""
        m = self.sink
        busy = g.device_busy_s - self._busy_published
        if busy > 0:  # a counter, published with the gauges
            m.inc("tandem_device_busy_seconds_total", busy)
            self._busy_published += busy
        m.set("tandem_decode_eager", 1.0 if g.eager else 0.0)
        m.set("tandem_inflight_streams", g.inflight)
        m.set("tandem_queued_requests", g.queued)
        m.set("tandem_free_pages", g.free_pages)
        m.set("tandem_held_pages", g.held_pages)
        m.set("tandem_draining", 1.0 if g.draining else 0.0)
        m.set("tandem_admittable_streams", 0 if g.draining else g.admittable)
        m.set("tandem_transfer_path_info", 1, path=g.path)
