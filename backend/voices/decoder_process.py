"""A reference's decoding in a short-lived process of its own, so that a native crash of FFmpeg or
PyAV on a hostile file is one failed registration, not a dead `voices` engine.

Why a process: decoding runs native code over bytes anyone may upload (FFmpeg's demuxers and
decoders, PyAV's frame conversion); a fault there (a segfault, an abort) ends the process it runs
in, and in the registrar's worker that ends every registration queued behind it and restarts the
engine (a loop of such uploads kept the engine down). A child per decode costs its start-up
(interpreter + PyAV + numpy, ~0.3 s on a 2-core CPU) against an encoder that takes seconds per
second of audio, and holds nothing between registrations.

The exchange, over pipes: the parent writes a JSON line (`sample_rate`, `min_seconds`,
`max_seconds`) then the file's bytes to the child's stdin; the child answers one JSON line — the
`Reference`'s scalars and the PCM's sample count, or `{"error": message}` for an `InvalidInput` —
followed, on success, by the PCM as little-endian float32. A child that dies by a signal, exits
otherwise, answers nothing readable, or outlives `timeout_s` (it is killed) is `InvalidInput`
naming AUDIO: the file is what made it fail, and nothing was stored.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from tandem.backend.errors import InvalidInput
from tandem.backend.voices.audio import Reference

DECODE_TIMEOUT_S = 60.0  # decoding 30 s of any codec takes well under a second; a hang ends here
_MODULE = "tandem.backend.voices.decoder_process"


def decode_isolated(
    data: bytes,
    sample_rate: int,
    min_seconds: float,
    max_seconds: float,
    timeout_s: float = DECODE_TIMEOUT_S,
    command: Sequence[str] = (),
) -> Reference:
    """`audio.decode_reference(data, ...)` run in a child process. Raises InvalidInput. `command`:
    the child's command line, this module's `main` by default (a test runs one that crashes)."""
    if not data:
        raise InvalidInput("AUDIO is empty: send the reference recording's file")
    head = json.dumps({"sample_rate": sample_rate, "min_seconds": min_seconds, "max_seconds": max_seconds})
    try:
        done = subprocess.run(
            list(command) or [sys.executable, "-m", _MODULE],
            input=head.encode() + b"\n" + data,
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise InvalidInput(f"AUDIO took longer than {timeout_s:g} s to decode; nothing was stored") from None
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode).name
        raise InvalidInput(f"AUDIO crashed the audio decoder ({sig}); nothing was stored")
    line, _, pcm = done.stdout.partition(b"\n")
    try:
        answer = json.loads(line)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or done.returncode not in (0, 2):
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        raise InvalidInput(
            f"AUDIO could not be decoded (the decoder exited with {done.returncode}: {tail[0][:200]})"
        )
    if "error" in answer:
        raise InvalidInput(str(answer["error"]))
    samples = np.frombuffer(pcm, dtype="<f4")
    if samples.shape[0] != answer["samples"]:
        raise InvalidInput("AUDIO could not be decoded (the decoder's answer was cut short)")
    return Reference(
        samples.astype(np.float32), answer["sample_rate"], answer["source_rate"], answer["duration_s"]
    )


def main() -> int:
    """The child: one request on stdin, one answer on stdout (module docstring)."""
    from tandem.backend.voices.audio import decode_reference

    raw = sys.stdin.buffer.read()
    head, _, data = raw.partition(b"\n")
    args = json.loads(head)
    out = sys.stdout.buffer
    try:
        ref = decode_reference(data, int(args["sample_rate"]), args["min_seconds"], args["max_seconds"])
    except InvalidInput as exc:
        out.write(json.dumps({"error": exc.detail}).encode() + b"\n")
        return 2
    pcm = np.ascontiguousarray(ref.pcm, dtype="<f4")
    scalars = {
        "sample_rate": ref.sample_rate,
        "source_rate": ref.source_rate,
        "duration_s": ref.duration_s,
        "samples": int(pcm.shape[0]),
    }
    out.write(json.dumps(scalars).encode() + b"\n")
    out.write(pcm.tobytes())
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
