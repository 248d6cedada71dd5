"""The monolithic engine: prefill and decode share one device and one loop (the baseline PD beats).

Each loop iteration first admits every pending request that fits (one prefill forward each, with
prefix caching), then runs one decode step over the running batch. A cold prompt's prefill therefore
pauses every playing stream on the device — exactly the stall the PD split removes — and both
engines share every other piece (decoder, batch, sampling, chunking), so `tts` and `tts_mono`
produce identical tokens for identical requests.
"""

from __future__ import annotations

import time

import torch

from tandem.backend.decoder import Decoder
from tandem.backend.engine_parts import make_batch, make_intake, make_pool
from tandem.backend.engine_thread import EngineThread
from tandem.backend.errors import PoolExhausted, StreamFailed
from tandem.backend.metrics import MetricsSink, PublishTimer
from tandem.backend.prefix_cache import PrefixCache
from tandem.backend.sampling import sample
from tandem.backend.settings import EngineSettings
from tandem.backend.stream import EngineRequest, Stream


class MonoEngine:
    def __init__(self, decoder: Decoder, settings: EngineSettings, metrics: MetricsSink) -> None:
        self.decoder = decoder
        self.settings = settings
        self.metrics = metrics
        self._publish_timer = PublishTimer()
        self.pool = make_pool(decoder, settings)
        self.cache = PrefixCache(self.pool, enabled=settings.pool.prefix_cache)
        self.batch = make_batch(decoder, self.pool, settings, metrics)
        self.intake = make_intake(settings, EngineRequest)
        self._thread = EngineThread("tandem-mono", self._iterate, self._fault)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._thread.stop()

    def submit(self, req: EngineRequest) -> None:
        """Called by Triton's execute thread; raises Overloaded when the queue is full."""
        self.intake.submit(req)

    def _iterate(self) -> None:
        self.intake.pull(0.0 if len(self.batch) else 0.05)
        for _ in self.intake.admit(self._prefill):
            pass
        self.batch.step()
        if self._publish_timer.due():
            self._publish()

    def _prefill(self, req: EngineRequest) -> bool:
        if len(self.batch) >= self.settings.batch.max_batch:
            return False
        rows_np = req.prompt
        t = rows_np.shape[0]
        try:
            alloc = self.cache.allocate(rows_np, extra_tokens=req.max_new_rows)
        except PoolExhausted:
            return False
        req.timings.mark("admit")
        self.metrics.observe("tandem_admission_ms", (time.monotonic() - req.received_s) * 1e3)
        try:
            slots = self.pool.slots(alloc.pages, t + req.max_new_rows)
            rows = torch.from_numpy(rows_np).to(self.pool.device)
            req.timings.mark("forward_start")
            start = alloc.cached_tokens
            logits = self.decoder.prefill(rows[start:], self.pool, slots[:t], start)
            first = sample(logits[None], [req.sampling], [t])[0].numpy()
            req.timings.mark("forward_end")
            self.cache.commit(alloc, rows_np)
        except Exception:
            self.cache.release(alloc)
            raise
        self.metrics.observe(
            "tandem_prefill_ms",
            (req.timings.get("forward_end") - req.timings.get("forward_start")) / 1e6,
        )
        self.metrics.inc("tandem_prefix_cache_hit_tokens_total", alloc.cached_tokens)
        stream = Stream(
            stream_id=req.stream_id,
            prompt_len=t,
            sampling=req.sampling,
            max_new_rows=req.max_new_rows,
            sink=req.sink,
            timings=req.timings,
            eos_token_id=self.decoder.cfg.eos_token_id,
            pages=alloc.pages,
            slots=slots,
        )
        self.batch.add(stream, first, lambda: self.cache.release(alloc))
        return True

    def _publish(self) -> None:
        m = self.metrics
        m.set("tandem_inflight_streams", len(self.batch))
        m.set("tandem_queued_requests", len(self.intake))
        m.set("tandem_free_pages", self.cache.available_pages)  # evictable cached pages count as free
        m.set("tandem_admittable_streams", max(0, self.settings.batch.max_batch - len(self.batch)))

    def _fault(self, reason: str) -> None:
        self.batch.fail_all(reason)
        self.intake.fail_all(StreamFailed(reason))
