"""A speech-like reference recording, synthesized (no recording can be downloaded here).

A voiced source at a gliding pitch (120-220 Hz, eleven harmonics) shaped by a moving formant-like
resonance, in syllables of ~0.2 s with short pauses, plus a little noise: enough like speech for a
codec's encoder to work on, deterministic per seed. Used by `tandem-bench-voices` and the tests.
"""

from __future__ import annotations

import io
import wave

import numpy as np


def speech_like(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """float32 mono in [-0.8, 0.8]."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    pitch = 170 + 50 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6)) + 10 * rng.standard_normal()
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voiced = sum((0.6 / k) * np.sin(k * phase) for k in range(1, 12))
    f1 = 500 + 300 * np.sin(2 * np.pi * 2.3 * t)
    formant = 0.5 + 0.5 * np.sin(2 * np.pi * np.cumsum(f1) / rate)
    syllables = (np.sin(2 * np.pi * 2.5 * t + rng.uniform(0, 6)) > -0.3).astype(np.float64)
    envelope = np.convolve(syllables, np.hanning(int(0.03 * rate)) / (0.015 * rate), mode="same")
    noise = 0.02 * rng.standard_normal(n)
    x = (voiced * formant * envelope) + noise
    return (0.8 * x / np.max(np.abs(x))).astype(np.float32)


def wav_bytes(pcm: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.rint(np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()
