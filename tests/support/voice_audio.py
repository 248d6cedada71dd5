"""Reference recordings and HTTP helpers for the registered-voice tests: speech-like audio
(`bench/reference_audio.py`) as WAV or, through PyAV, any other container (FLAC, ...), and a
multipart upload to the gateway."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
import wave
from typing import Any

import av
import numpy as np

from tandem.bench.reference_audio import speech_like, wav_bytes

__all__ = [
    "encoded_bytes",
    "flac_layout",
    "http_call",
    "multipart",
    "register_http",
    "speech_like",
    "wav_bytes",
    "wav_channels",
]


def encoded_bytes(pcm: np.ndarray, rate: int, container: str = "flac", codec: str = "flac") -> bytes:
    """`pcm` in another container and codec (FLAC by default), through PyAV."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(
            np.rint(pcm * 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono"
        )
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def multipart(fields: dict[str, str], file: bytes | None, filename: str = "ref.wav") -> tuple[bytes, str]:
    """A multipart/form-data body of `fields` and an optional `file` part: (body, content type)."""
    boundary = "tandem-test-boundary-7d1f"
    parts = []
    for key, value in fields.items():
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode()
        )
    if file is not None:
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        )
        parts.append(head.encode() + file + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def http_call(
    method: str,
    url: str,
    body: bytes | None = None,
    content_type: str | None = None,
    timeout: float = 300.0,
    key: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """An HTTP request (with `Authorization: Bearer key` when `key` is given): (status, JSON body),
    an error's included."""
    headers = {"Content-Type": content_type} if content_type else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, body, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def register_http(
    base: str,
    name: str,
    transcript: str | None,
    file: bytes | None,
    timeout: float = 300.0,
    key: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """POST /v1/voices on the gateway at `base` (a field given as None is left out; `key`: the
    caller's API key)."""
    fields = {"name": name} if name is not None else {}
    if transcript is not None:
        fields["transcript"] = transcript
    body, ctype = multipart(fields, file)
    return http_call("POST", f"{base}/v1/voices", body, ctype, timeout, key)


def wav_channels(channels: int, seconds: float = 2.0, rate: int = 16000) -> bytes:
    """A WAV of `channels` identical channels of speech-like audio."""
    pcm = np.rint(speech_like(seconds, rate) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(pcm.reshape(-1, 1), channels, axis=1).tobytes())
    return buf.getvalue()


def flac_layout(layout: str, seconds: float = 2.0, rate: int = 16000) -> bytes:
    """A FLAC of `layout` (every channel the same speech-like audio), through PyAV."""
    channels = av.AudioLayout(layout).nb_channels
    pcm = np.rint(speech_like(seconds, rate) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="flac") as out:
        stream = out.add_stream("flac", rate=rate, layout=layout)
        data = np.repeat(pcm.reshape(-1, 1), channels, axis=1).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(data, format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()
