"""How many rows go into each audio chunk of a stream: sizes that follow the listener's lead.

A client plays a stream's audio at real time from its first sounding chunk on. Its **lead** is the
audio it has been sent less the wall time since that first audio: the seconds buffered at a
real-time listener. A chunk of N rows takes N / g seconds to generate (g: the stream's rate in
rows/s) while the listener plays on, so a chunk whose audio is longer than the lead it was cut at
empties the listener's buffer before it arrives unless the stream runs well above real time. A
fixed growth (4, 8, 16, 32 rows) does exactly that at real-time rates: a 112-row Orpheus chunk is
1.37 s of audio delivered every ~1.37 s.

So after every chunk the next chunk's size is chosen from the lead at that moment: the largest rung
of a ladder of sizes whose audio is at most `lead_fraction` of the lead (never below the ladder's
first rung, one codec frame by default). The chunk arrives after its rows are generated; for a
stream at g >= real time that leaves the listener at least (1 - lead_fraction * rt / g) of the
lead, and every chunk adds its audio back, so the lead grows by (1 - rt / g) of the wall time
(1.2x real time: a sixth of a second per second) and the chunks grow with it, up to `max_rows`.
The first chunk is `first_rows` whatever the lead, and so is every chunk before one sounds (nobody
is listening yet), so first audio is as early as a fixed schedule's. A listener that ran dry waits
for the next chunk and plays on from its arrival: its lead restarts there, it is not owed the stall.

Sizes come from a ladder (the first rung, then x`growth` per rung, in whole codec frames, up to
`max_rows`) rather than any row count, so a vocoder batch of many streams' chunks holds few window
lengths (a codec's device call serves one length). The size is chosen once per chunk, at the
previous chunk's emission, so a chunk never ends off its rung (the final chunk holds what is left).

`lead_fraction` 0 is the fixed schedule: `first_rows * growth**i` rows, capped at `max_rows`,
whatever the listener has (the A/B baseline for a bench's stall count).

Chunk sizes never change what the client hears: a codec window carries its own context
(backend/codec/base.py), so chunking is a latency / overhead trade-off only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.backend.codec.base import Framing, RowLayout

# Float slack when a budget lands on a rung exactly (a lead of 4 rows at fraction 0.5 allows 2).
_EPS = 1e-9


@dataclass(frozen=True)
class ChunkPolicy:
    """Chunk sizes of a stream; see the module docstring.

    first_rows: the first chunk (and each before one sounds). growth: ratio between rungs of the
    ladder (and, fixed schedule, between chunks). max_rows: the largest chunk. framing: how rows
    become codec frames and the context each chunk carries. lead_fraction: a chunk's audio is at most
    this share of the listener's lead (0: the fixed schedule). min_rows: the ladder's first rung (0:
    one codec frame). rows_per_second: real time in rows (the codec's clock, `CodecSpec`).
    """

    first_rows: int = 4
    growth: float = 2.0
    max_rows: int = 32
    framing: Framing = field(default_factory=lambda: Framing(RowLayout()))
    lead_fraction: float = 0.0
    min_rows: int = 0
    rows_per_second: float = 21.0

    def __post_init__(self) -> None:
        if self.first_rows < 1:
            raise ValueError(f"first_rows must be >= 1, got {self.first_rows}")
        if not (math.isfinite(self.growth) and self.growth >= 1.0):
            raise ValueError(f"growth must be a finite number >= 1, got {self.growth}")
        if self.max_rows < self.first_rows:
            raise ValueError(f"max_rows ({self.max_rows}) must be >= first_rows ({self.first_rows})")
        if not (math.isfinite(self.lead_fraction) and 0.0 <= self.lead_fraction <= 1.0):
            raise ValueError(f"lead_fraction must be in [0, 1] (0: fixed sizes), got {self.lead_fraction}")
        if not 0 <= self.min_rows <= self.max_rows:
            raise ValueError(f"min_rows must be in [0, max_rows={self.max_rows}], got {self.min_rows}")
        if not (math.isfinite(self.rows_per_second) and self.rows_per_second > 0):
            raise ValueError(f"rows_per_second must be a positive number, got {self.rows_per_second}")

    @property
    def follows_lead(self) -> bool:
        return self.lead_fraction > 0

    @property
    def frame_seconds(self) -> float:
        """Audio of one codec frame, in seconds of real time."""
        return self.framing.layout.rows_per_frame / self.rows_per_second

    @property
    def ladder(self) -> tuple[int, ...]:
        """The sizes a lead-following chunk may have, ascending: the first rung (`min_rows`, else one
        frame), then x`growth` rounded to whole frames (one frame more at least), capped at max_rows."""
        frame = self.framing.layout.rows_per_frame
        rung = min(self.max_rows, self.min_rows or frame)
        rungs = [rung]
        while rung < self.max_rows:
            grown = max(rung + frame, round(rung * self.growth / frame) * frame)
            rung = min(self.max_rows, grown)
            rungs.append(rung)
        return tuple(rungs)

    def lead_s(self, frames_sent: int, playing_since_s: float | None, now_s: float) -> float | None:
        """The listener's lead in seconds at `now_s`: the audio of the `frames_sent` frames it was sent
        less the time since its first audio at `playing_since_s` (None: nothing sounds yet)."""
        if playing_since_s is None:
            return None
        return frames_sent * self.frame_seconds - (now_s - playing_since_s)

    def playing_since(
        self, frames_before: int, frames_after: int, playing_since_s: float | None, now_s: float
    ) -> float | None:
        """The listener's clock origin once a chunk leaves at `now_s`, its frames taking the frames
        sent from `frames_before` to `frames_after`: `now_s` for the first that sounds; and a listener
        that ran dry before it (lead < 0) waited for it, then plays on, so its clock slips by the wait
        (as a player and `bench/capacity.py`'s stall count see it) and a late chunk does not keep the
        stream's chunks small for ever."""
        if playing_since_s is None:
            return now_s if frames_after > 0 else None
        lead = self.lead_s(frames_before, playing_since_s, now_s)
        assert lead is not None
        return playing_since_s - min(0.0, lead)

    def next_rows(self, chunk_index: int, lead_s: float | None) -> int:
        """Rows in chunk `chunk_index` (0-based), chosen when chunk `chunk_index - 1` left with the
        listener `lead_s` seconds ahead (None: no audio sent yet)."""
        if not self.follows_lead:
            return self.next_size(chunk_index)
        if chunk_index == 0 or lead_s is None:
            return self.first_rows
        budget = self.lead_fraction * lead_s * self.rows_per_second + _EPS
        ladder = self.ladder
        fits = [r for r in ladder if r <= budget]
        return fits[-1] if fits else ladder[0]

    def next_size(self, chunk_index: int) -> int:
        """The fixed schedule: first_rows * growth**index, capped at max_rows."""
        if chunk_index < 0:
            raise ValueError(f"chunk_index must be >= 0, got {chunk_index}")
        size = float(self.first_rows)
        for _ in range(chunk_index):  # iterative, so huge indices cannot overflow a float power
            size *= self.growth
            if size >= self.max_rows:
                return self.max_rows
        return min(self.max_rows, max(1, round(size)))

    def chunk_sizes(self, total_rows: int) -> list[int]:
        """The fixed schedule's sizes for a stream of `total_rows` rows; the last holds what is left."""
        if total_rows < 0:
            raise ValueError(f"total_rows must be >= 0, got {total_rows}")
        sizes: list[int] = []
        left = total_rows
        while left > 0:
            size = min(left, self.next_size(len(sizes)))
            sizes.append(size)
            left -= size
        return sizes

    def window_frames(self, rows_per_frame: int, chunks: int = 64) -> list[int]:
        """Frame counts of the windows a stream's non-final chunks carry (as `FrameTrack.window` cuts
        them), each once, in order of first appearance; the first is the first sounding chunk's.
        Following the lead, sizes after the first sound depend on time: then the list ends with the
        longest window any chunk can carry (a largest chunk's frames plus its context), and a GPU
        codec warms every length up to it."""
        lookback, lookahead = self.framing.lookback, self.framing.lookahead
        out: list[int] = []
        rows = emitted = 0
        for i in range(chunks):
            if self.follows_lead and emitted:
                break
            rows += self.first_rows if self.follows_lead else self.next_size(i)
            frames = rows // rows_per_frame
            emit_to = max(emitted, frames - lookahead)
            if emit_to > emitted:
                n = frames - max(0, emitted - lookback)
                if n not in out:
                    out.append(n)
                emitted = emit_to
        if self.follows_lead:
            # a chunk completes at most ceil(max_rows / rows_per_frame) frames; its window adds the
            # frames held back for lookahead by the chunk before and the lookback
            longest = -(-self.max_rows // rows_per_frame) + lookback + lookahead
            if longest not in out:
                out.append(longest)
        return out
