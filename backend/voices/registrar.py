"""The `voices` engine: registers a voice by encoding its reference once, lists and deletes voices.

It runs in the `voices` model's own worker process (`tandem-engine voices voices_0 --kind voices`,
built by `backend/worker/host.py`, supervised by its stub like every engine; docs/architecture.md,
"Processes"), never in a stub and never in another engine's process: SNAC's encoder takes seconds
of CPU per second of audio (a 10 s reference ~12 s on a 2-core CPU; docs/benchmarks), which would
stall a stub (Triton 2.51 aborts the server when a stalled stub resumes) or pause every stream of the
engine it shared a process with. Here it pauses nothing but later registrations: speech goes
through other processes, which see the new voice on their next request (`store.py`).

Threads: the worker's reader thread calls `submit`: `list` and `delete` are answered at once (file
system operations of microseconds); a `register` is checked (the name free, not pending, the queue
not full) and queued. The registrar's own thread (`tandem-voices`) takes one registration at a time:
decode (`audio.py`, in a child process of its own: `decoder_process.py`) -> the codec's encoder ->
`VoiceStore.add` (atomic) -> answer. `_pending` (names queued or encoding) is shared under `_lock`.
The thread, `loop_age_s` and `close` are the engine shell's (`backend/engine_shell.py`), as for every
engine. `loop_age_s` grows with the running registration: the stub's stall watchdog reads it, so the
`voices` model's `tandem.worker.stall_timeout_s` must exceed the longest encode (its config sets 300 s).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem.backend.codec.base import Encoder
from tandem.backend.engine_shell import EngineShell
from tandem.backend.errors import AlreadyExists, Overloaded, TandemError
from tandem.backend.settings import VoiceSettings
from tandem.backend.voices.decoder_process import decode_isolated
from tandem.backend.voices.request import Action, VoiceRequest
from tandem.backend.voices.store import VoiceRecord, VoiceStore

log = logging.getLogger("tandem")


class VoiceSink(Protocol):
    """One request's answer: exactly one `answer` or one `fail`, from either thread."""

    def answer(self, result: dict[str, object]) -> None: ...

    def fail(self, error: TandemError) -> None: ...


@dataclass(frozen=True)
class VoiceJob:
    request: VoiceRequest
    sink: VoiceSink


class VoiceRegistrar(EngineShell[VoiceJob]):
    """Owns the store's writes for its process; `submit` from the reader thread."""

    def __init__(
        self,
        encoder: Encoder,
        frame_width: int,
        store: VoiceStore,
        settings: VoiceSettings,
        builtin: Sequence[str],
    ) -> None:
        self.encoder = encoder
        self.frame_width = frame_width
        self.store = store
        self.settings = settings
        self.builtin = tuple(builtin)
        self._queue: queue.Queue[VoiceJob | None] = queue.Queue(maxsize=max(1, settings.max_pending))
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        super().__init__("tandem-voices", None, join_s=5.0)

    def _prepare(self) -> None:
        swept = self.store.sweep()
        if swept:
            log.warning("voice store %s: removed %d files a crashed writer left", self.store.dir, swept)

    def _stopping(self) -> None:
        """Every queued registration is refused; the loop wakes (None) and ends after the running one."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.sink.fail(Overloaded("voices: the model is being unloaded"))
        self._queue.put(None)

    # ---- the reader thread ----------------------------------------------------------------------

    def submit(self, job: VoiceJob) -> None:
        req = job.request
        try:
            if req.action is Action.LIST:
                job.sink.answer(self.listing())
            elif req.action is Action.DELETE:
                self.store.remove(req.name)
                log.info("voice %r deleted", req.name)
                job.sink.answer({"deleted": req.name})
            else:
                self._queue_registration(job)
        except TandemError as err:
            job.sink.fail(err)

    def listing(self) -> dict[str, object]:
        builtin = [{"id": v, "builtin": True} for v in self.builtin if v != "*"]
        return {"voices": [*builtin, *(r.summary() for r in self.store.records())]}

    def _queue_registration(self, job: VoiceJob) -> None:
        name = job.request.name
        with self._lock:
            if name in self._pending or self.store.get(name) is not None:
                raise AlreadyExists(f"NAME {name!r} is already a registered voice")
            # No owner is known here (one API key for the unit): the store's own size is the bound.
            held = len(self.store.names()) + len(self._pending)
            if held >= self.settings.max_voices:
                raise Overloaded(
                    f"voices: {held} voices are registered or being registered, the limit is "
                    f"{self.settings.max_voices}; delete one first"
                )
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise Overloaded(
                    f"voices: {self._queue.maxsize} registrations are waiting for the encoder; retry later"
                ) from None
            self._pending.add(name)

    # ---- the registrar's thread -----------------------------------------------------------------

    def _iterate(self) -> None:
        """One registration, or none within 0.1 s (the loop then sees a stop)."""
        try:
            job = self._queue.get(timeout=0.1)
        except queue.Empty:
            return
        if job is None:
            return
        try:
            job.sink.answer(self.register(job.request))
        except TandemError as err:
            job.sink.fail(err)
        except Exception as exc:  # one bad registration must not end the registrar
            log.exception("voice %r: registration failed", job.request.name)
            job.sink.fail(TandemError(f"voice registration failed: {type(exc).__name__}: {exc}"))
        finally:
            with self._lock:
                self._pending.discard(job.request.name)

    def _fault(self, reason: str) -> None:
        """A sink that raised while answering: its job is over (its name no longer pending); the
        registrar owns nothing else to fail."""

    def register(self, req: VoiceRequest) -> dict[str, object]:
        """Decode, encode, store; the stored voice's summary. Raises TandemError (InvalidInput for
        the audio, AlreadyExists for a name taken meanwhile)."""
        t0 = time.monotonic()
        s, spec = self.settings, self.encoder.spec
        ref = decode_isolated(req.audio, spec.sample_rate, s.min_seconds, s.max_seconds)
        t1 = time.monotonic()
        frames = self.encoder.encode(ref.pcm, self.frame_width)
        t2 = time.monotonic()
        record = VoiceRecord(
            name=req.name,
            transcript=req.transcript,
            frames=frames.tolist(),
            codec=spec.kind,
            sample_rate=spec.sample_rate,
            samples_per_frame=spec.samples_per_frame,
            duration_s=ref.duration_s,
            source_rate=ref.source_rate,
            created=time.time(),
        )
        self.store.add(record)
        t3 = time.monotonic()
        log.info(
            "voice %r registered: %.1f s at %d Hz -> %d frames (decode %.2f s, encode %.2f s, store %.3f s)",
            req.name,
            ref.duration_s,
            ref.source_rate,
            frames.shape[0],
            t1 - t0,
            t2 - t1,
            t3 - t2,
        )
        timing = {"decode_s": t1 - t0, "encode_s": t2 - t1, "store_s": t3 - t2}
        return {**record.summary(), "seconds": {k: round(v, 4) for k, v in timing.items()}}
