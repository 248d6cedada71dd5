"""A `VoiceRecord` to store: small, valid, its fields chosen by the test."""

from __future__ import annotations

from tandem.backend.voices.store import VoiceRecord


def record(name: str, transcript: str = "hello there", frames: int = 3, code: int = 1) -> VoiceRecord:
    return VoiceRecord(
        name=name,
        transcript=transcript,
        frames=[[code] * 7 for _ in range(frames)],
        codec="snac",
        sample_rate=24000,
        samples_per_frame=2048,
        duration_s=1.5,
        source_rate=16000,
        created=1.0,
    )
