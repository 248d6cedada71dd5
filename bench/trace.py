"""Load traces for `tandem-bench`: what arrives, with which voice, how long, how much to generate.

A trace is JSON lines, one request each: `{"t": arrival_s, "voice": "v3", "voice_rows": 1400,
"text_rows": 40, "output_rows": 220}`. The prompt is the voice's reference rows (a pure function of
the voice name, so a reused voice hits P's prefix cache, as in production) followed by the request's
own text rows. `generate` makes seed-like traces: 1–2k-row prompts, a pool of voices reused with
some probability, and cold voices seen once.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    t: float
    voice: str
    voice_rows: int
    text_rows: int
    output_rows: int

    def prompt(self, width: int, vocab: int, index: int) -> np.ndarray:
        """The request's prompt: voice reference rows (shared per voice) + its own text rows."""
        vseed = int.from_bytes(hashlib.blake2b(self.voice.encode(), digest_size=8).digest(), "little")
        voice = np.random.default_rng(vseed).integers(0, vocab, size=(self.voice_rows, width), dtype=np.int64)
        text = np.random.default_rng([vseed, index]).integers(
            0, vocab, size=(self.text_rows, width), dtype=np.int64
        )
        return np.concatenate([voice, text])


def generate(
    n: int,
    *,
    seed: int = 0,
    rate_per_s: float = 4.0,
    voices: int = 16,
    reuse_p: float = 0.7,
    prompt_rows: tuple[int, int] = (1000, 2000),
    text_rows: tuple[int, int] = (20, 80),
    output_rows: tuple[int, int] = (150, 300),
) -> list[TraceRequest]:
    """Poisson arrivals; with probability `reuse_p` a request uses one of `voices` warm voices, else a
    cold voice nobody used before (a full-length prefill)."""
    rng = np.random.default_rng(seed)
    warm = [(f"warm{i}", int(rng.integers(*prompt_rows))) for i in range(voices)]
    t, out = 0.0, []
    for i in range(n):
        t += float(rng.exponential(1.0 / rate_per_s))
        text = int(rng.integers(*text_rows))
        if rng.random() < reuse_p:
            name, rows = warm[int(rng.integers(voices))]
        else:
            name, rows = f"cold{seed}-{i}", int(rng.integers(*prompt_rows))
        voice_rows = max(1, rows - text)
        out.append(TraceRequest(round(t, 4), name, voice_rows, text, int(rng.integers(*output_rows))))
    return out


def save(path: Path, trace: list[TraceRequest]) -> None:
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in trace))


def load(path: Path) -> list[TraceRequest]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append(
                TraceRequest(
                    float(d["t"]),
                    str(d["voice"]),
                    int(d["voice_rows"]),
                    int(d["text_rows"]),
                    int(d["output_rows"]),
                )
            )
    return out
