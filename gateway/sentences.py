"""Text as users send it -> sentence segments, in bounded time per character.

Segments (`SentenceQueue`):
- sentences by pysbd's English rules (`clean=False`: the text is kept as sent, abbreviations such as
  "Dr." and "p.m." do not end a sentence); fed in pieces, a sentence is complete once pysbd starts
  another after it, at `flush`, or at `settle` (the caller's quiet after the text: the buffer is
  complete if pysbd would start a sentence after it, asked with `PROBE` appended);
- one segment is as many whole sentences as fit in `max_chars` (`SEGMENT_CHARS`, 300: what one
  Orpheus stream speaks well, ~20 s of speech, within one stream's default length; Baseten's Orpheus
  example chunks at ~300 too), except a turn's first segment, which is its first sentence alone
  so the first audio waits on one sentence's prefill, not a paragraph's;
- a sentence longer than `max_chars` is split at the last clause mark (`,;:` or a dash) before the
  limit, else the last space, else at the limit (never a piece under half of it but the last).
Segments are stripped of surrounding whitespace and joined with one space; blank ones are dropped.

A line break ends a sentence (a list, a poem, a heading is spoken line by line).

Cost. pysbd is superlinear on some text (8,000 characters of "a\\n" took 1.57 s in one call, of
"1. " 0.78 s; measured per 600 characters: 131 ms of "a\\n", 62 ms of "1. ", against 9 ms of
46 short sentences of prose): its time grows with the square of the sentence marks it sees. So
pysbd never sees more than one line of at most `span` (2 x `max_chars`) characters at once (a
sentence never exceeds `max_chars` anyway: a longer buffer is cut into spans, each span's last,
possibly unfinished, sentence carried into the next), a line without a mark (`.`, `!`, `?`, ...)
is one sentence without asking it, and a line with more than `MAX_MARKS` marks (a sentence of
under 20 characters on average: a list of numbers, a hostile text) is split by a plain rule
(after `.`, `!`, `?` followed by white space). Each call is then bounded, and a text's cost linear
in its length. On top of that a queue spends at most `budget_s` of pysbd's time
(`PYSBD_BUDGET_S`), then uses the plain rule for the rest, so no client buys more than that of the
gateway's CPU per turn or request.
The gateway runs `feed`/`flush` on `TEXT_EXECUTOR` (one thread), never on its event loop; a queue
is fed by one caller at a time.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import pysbd

SEGMENT_CHARS = 300  # one segment's most characters (module docstring)
PROBE = "Then it went on."  # what `settle` appends: a sentence pysbd starts after any complete one
PYSBD_BUDGET_S = 0.25  # pysbd's time per queue (a turn, a request), then the plain rule
_CLAUSE = re.compile(r"[,;:\u2013\u2014](?=\s)|\s[-\u2013\u2014]\s")
_PLAIN = re.compile(r"(?<=[.!?])\s+")
_LINES = re.compile(r"(?<=\n)")
_MARKS = re.compile(r"[.!?\u2026\u3002]")
MAX_MARKS = 32  # pysbd's time grows with the square of a span's sentence marks: past this, the plain rule

# Segmentation is CPU work in Python: it runs here, one call at a time, so the event loop only
# waits for the GIL's switch interval, not for a text (gateway/app.py, gateway/ws.py).
TEXT_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-text")


class BufferFull(ValueError):
    """More unspoken text than the session holds (`SentenceQueue.max_pending_chars`)."""


def split_long(sentence: str, max_chars: int) -> list[str]:
    """`sentence` in pieces of at most `max_chars`: cut after the last clause mark, else the last
    space, in the second half of the limit; else at the limit."""
    out: list[str] = []
    rest = sentence
    while len(rest) > max_chars:
        window = rest[: max_chars + 1]
        cut = 0
        for m in _CLAUSE.finditer(window):
            if max_chars // 2 <= m.end() <= max_chars:
                cut = m.end()
        if not cut:
            space = window.rfind(" ", max_chars // 2)
            cut = space if space > 0 else max_chars
        out.append(rest[:cut])
        rest = rest[cut:]
    out.append(rest)
    return out


class SentenceQueue:
    """Text in, in any pieces; segments out (module docstring). Not thread-safe; one per turn."""

    def __init__(
        self,
        max_chars: int = SEGMENT_CHARS,
        max_pending_chars: int | None = None,
        budget_s: float = PYSBD_BUDGET_S,
    ) -> None:
        if max_chars < 2:
            raise ValueError(f"max_chars = {max_chars}: at least 2")
        self.max_chars = max_chars
        self.span = 2 * max_chars
        self.max_pending_chars = max_pending_chars
        self.budget_s = budget_s
        self.spent_s = 0.0  # pysbd's time so far
        self._segmenter = pysbd.Segmenter(language="en", clean=False)
        self._buffer = ""  # text not yet known to end a sentence
        self._sentences: deque[str] = deque()  # complete sentences, none longer than max_chars
        self.first = True  # the next segment is the turn's first (spoken alone)
        self.flushed = False

    @property
    def pending_chars(self) -> int:
        """Characters fed and not yet taken."""
        return len(self._buffer) + sum(len(s) for s in self._sentences)

    def feed(self, text: str) -> None:
        """Add a piece of text; raises BufferFull (and keeps nothing of it) past `max_pending_chars`."""
        if self.max_pending_chars is not None and self.pending_chars + len(text) > self.max_pending_chars:
            raise BufferFull(
                f"{self.pending_chars + len(text)} characters would wait unspoken; the limit is "
                f"{self.max_pending_chars}"
            )
        self.flushed = False
        self._buffer += text
        self._scan(final=False)

    def flush(self) -> None:
        """The text so far is complete: what is buffered becomes segments."""
        self._scan(final=True)
        self.flushed = True

    def settle(self) -> bool:
        """The text stopped arriving for a while: if the buffer (its last, unfinished sentence)
        would end where pysbd starts a sentence after it, it is complete: queued as one. "Hello
        there." settles; "I met Dr." and "It costs" do not. True when it did."""
        if not self._buffer.strip():
            return False
        gap = "" if self._buffer[-1].isspace() else " "
        parts = self._sentences_of(self._buffer + gap + PROBE)
        if len(parts) < 2 or parts[-1].strip() != PROBE:
            return False
        self._push([self._buffer])
        self._buffer = ""
        return True

    @property
    def ready(self) -> bool:
        """`take` has a segment to give (a complete sentence waits), or nothing more will come."""
        return bool(self._sentences) or self.done

    def _scan(self, final: bool) -> None:
        """Move every complete sentence of the buffer to the queue, one bounded span at a time."""
        while len(self._buffer) > self.span:
            span, rest = self._buffer[: self.span], self._buffer[self.span :]
            parts = self._sentences_of(span)
            tail = parts[-1] if len(parts) > 1 else ""
            if tail and span.endswith(tail):  # the span's last sentence may go on in the rest
                self._push(parts[:-1])
                self._buffer = tail + rest
            else:  # no boundary in the span (or pysbd changed its tail): cut it by length
                *heads, last = split_long(span, self.max_chars)
                self._push(heads)
                self._buffer = last + rest
        if final:
            if self._buffer.strip():
                self._push(self._sentences_of(self._buffer))
            self._buffer = ""
            return
        parts = self._sentences_of(self._buffer) if self._buffer.strip() else []
        if len(parts) > 1:
            self._push(parts[:-1])
            self._buffer = parts[-1]
        if len(self._buffer) > self.max_chars:  # a sentence that will not fit: speak its head now
            *heads, self._buffer = split_long(self._buffer, self.max_chars)
            self._push(heads)

    def _sentences_of(self, text: str) -> list[str]:
        """The sentences of `text` (at most `span` characters): a line break ends one; a line is
        pysbd's within the budget and `MAX_MARKS`, else the plain rule's; a line without a mark is
        one sentence as it is."""
        out: list[str] = []
        for line in _LINES.split(text):
            if not line:
                continue
            marks = len(_MARKS.findall(line))
            if not marks:
                out.append(line)
            elif marks > MAX_MARKS or self.spent_s >= self.budget_s:
                out.extend(p for p in _PLAIN.split(line) if p)
            else:
                t0 = time.thread_time()
                try:
                    out.extend(self._segmenter.segment(line))
                finally:
                    self.spent_s += time.thread_time() - t0
        return out or [text]

    def _push(self, sentences: Iterable[str]) -> None:
        for s in sentences:
            self._sentences.extend(split_long(s, self.max_chars))

    def take(self) -> str | None:
        """The next segment, or None when no complete sentence waits."""
        while self._sentences:
            segment = self._sentences.popleft().strip()
            while not self.first and self._sentences:  # pysbd may drop a boundary's space: one between
                nxt = self._sentences[0].strip()
                if len(segment) + 1 + len(nxt) > self.max_chars:
                    break
                segment = f"{segment} {nxt}" if segment and nxt else segment or nxt
                self._sentences.popleft()
            if segment:
                self.first = False
                return segment
        return None

    @property
    def done(self) -> bool:
        """Flushed and everything taken."""
        return self.flushed and not self._sentences and not self._buffer.strip()


def segments(text: str, max_chars: int = SEGMENT_CHARS) -> list[str]:
    """A whole text's segments, in order."""
    q = SentenceQueue(max_chars)
    q.feed(text)
    q.flush()
    out = []
    while (s := q.take()) is not None:
        out.append(s)
    return out
