"""The monolithic engine: prefill and decode share one device and one loop (the baseline).

Each iteration plans one prefill forward over the pending requests (`plan_prefill`, as P does, and
no more than the running batch has room for), runs it (prefix-cached), then runs one decode step
over the batch, so a cold prefill pauses every playing stream.
Every other piece (decoder, batch, sampling, chunking) is shared with P and D, so `tts` and
`tts_mono` give identical tokens for identical requests (on a GPU, up to the rounding of which
prompts shared a forward).
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.backend.engine_shell import EngineShell
from tandem.backend.engines.parts import make_batch, make_intake, make_pool
from tandem.backend.engines.prefill_run import PrefillRun
from tandem.backend.engines.stream import EngineRequest, Stream
from tandem.backend.errors import StreamFailed
from tandem.backend.kv.prefix_cache import PrefixAllocation, PrefixCache
from tandem.backend.metrics import MetricsSink, PublishTimer
from tandem.backend.model.decoder import Decoder
from tandem.backend.model.row_step import RowStep
from tandem.backend.model.warm_up import warm_up
from tandem.backend.settings import EngineSettings


class MonoEngine(EngineShell[EngineRequest]):
    def __init__(
        self,
        decoder: Decoder,
        settings: EngineSettings,
        metrics: MetricsSink,
        row_step: RowStep | None = None,
    ) -> None:
        """`row_step`: the family's row maker over `decoder` (backend/model/row_step.py; None: a
        plain decoder's head and sampler)."""
        self.decoder = decoder
        self.settings = settings
        self.metrics = metrics
        self._publish_timer = PublishTimer()
        self.pool = make_pool(decoder, settings)
        self.cache = PrefixCache(self.pool, enabled=settings.pool.prefix_cache)
        self.batch = make_batch(decoder, self.pool, settings, metrics, row_step=row_step)
        self.intake = make_intake(settings, EngineRequest)
        super().__init__("tandem-mono", self.intake)

    def _prepare(self) -> None:
        warm_up(self.decoder, self.pool)

    def _iterate(self) -> None:
        """The scheduler's plan over the queue (at most the running batch's free places), run: one
        forward whose prompts join the batch (`_prefill`); then the batch's next step. On any error in
        the prefill every prompt not yet in the batch fails and its pages come back; the error goes on
        to the shell's fault policy."""
        self.intake.pull(0.0 if len(self.batch) else 0.05)
        room = self.settings.batch.max_batch - len(self.batch)
        run: PrefillRun[EngineRequest] = PrefillRun(self.cache, self.metrics)
        try:
            run.take(self.intake, self.settings.batch, decode_room=True, room=room)
            if run:
                self._prefill(run)
        except BaseException as exc:
            run.fail_rest(StreamFailed(f"prefill failed: {type(exc).__name__}: {exc}"))
            raise
        self.batch.advance()  # queue the next step, then finish the one before it (backend/engines/batch.py)
        if self._publish_timer.due():
            self._publish()

    def _prefill(self, run: PrefillRun[EngineRequest]) -> None:
        """One forward over the run's prompts; each then joins the running batch with its row 0. A
        join that raises fails the prompts after it, then raises."""
        tables = [
            self.pool.slots(alloc.pages, req.prompt.shape[0] + req.max_new_rows) for req, alloc in run.members
        ]
        firsts = run.forward(self.batch.rows, self.pool, tables)
        for i, (req, alloc) in enumerate(run.members):
            run.handed(i)
            try:
                self._join(req, alloc, tables[i], firsts[i])
            except Exception as exc:
                run.fail_rest(StreamFailed(f"prefill hand-off failed: {type(exc).__name__}: {exc}"))
                raise

    def _join(
        self, req: EngineRequest, alloc: PrefixAllocation, slots: torch.Tensor, first: np.ndarray
    ) -> None:
        """A prefilled prompt joins the running batch (which owns its pages from `add` on)."""
        try:
            self.cache.commit(alloc, req.prompt)
        except Exception:
            self.cache.release(alloc)
            raise
        stream = Stream(
            stream_id=req.stream_id,
            prompt_len=req.prompt.shape[0],
            sampling=req.sampling,
            max_new_rows=req.max_new_rows,
            sink=req.sink,
            timings=req.timings,
            eos_token_id=self.decoder.cfg.eos_token_id,
            pages=alloc.pages,
            slots=slots,
        )
        self.batch.add(stream, first, lambda a=alloc: self.cache.release(a))

    def _publish(self) -> None:
        m = self.metrics
        m.set("tandem_decode_eager", 1.0 if self.batch.graphs_failed else 0.0)
        m.set("tandem_inflight_streams", len(self.batch))
        m.set("tandem_queued_requests", len(self.intake))
        m.set("tandem_free_pages", self.cache.available_pages)  # evictable cached pages count as free
        m.set("tandem_admittable_streams", max(0, self.settings.batch.max_batch - len(self.batch)))

    def _fault(self, reason: str) -> None:
        self.batch.fail_all(reason)
        self.intake.fail_all(StreamFailed(reason))
