"""The gRPC client of the `voices` model: register a voice from a reference recording, list, delete.

`voices` answers each request once (RESULT: JSON), so this is plain `infer`, not a stream. Errors
come back as `VoiceError` with the code by `gateway/errors.classify` (INVALID_ARG naming NAME,
TRANSCRIPT or AUDIO; ALREADY_EXISTS; NOT_FOUND; UNAVAILABLE). `voice_inputs` builds the inputs for
this client and for the gateway's aio one (`gateway/voices.py`). Registration encodes the reference
on the server (seconds per second of audio on a CPU), hence the long default timeout.
"""

from __future__ import annotations

import json
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tandem.gateway.client import scalar_input
from tandem.gateway.errors import ClientError, classify
from tandem.wire import contract as wire

MODEL = wire.VOICES.name
REGISTER_TIMEOUT_S = 600.0


class VoiceError(Exception):
    def __init__(self, error: ClientError) -> None:
        super().__init__(str(error))
        self.error = error


def voice_inputs(
    action: str, name: str | None = None, transcript: str | None = None, audio: bytes | None = None
) -> list[grpcclient.InferInput]:
    values = (
        (wire.ACTION, action),
        (wire.NAME, name),
        (wire.TRANSCRIPT, transcript),
        (wire.REFERENCE, audio),
    )
    return [scalar_input(spec, value) for spec, value in values if value is not None]


def result_of(result: Any) -> dict[str, Any]:
    """A `voices` response's one output, RESULT, as the JSON object it holds."""
    return result_json(result.as_numpy(wire.RESULT.name)[0])


def result_json(raw: Any) -> dict[str, Any]:
    """RESULT's JSON (`result_of`)."""
    return dict(json.loads(raw.decode() if isinstance(raw, bytes) else str(raw)))


class VoiceClient:
    """Blocking calls to one server's `voices` model."""

    def __init__(self, url: str) -> None:
        self._client = grpcclient.InferenceServerClient(url)

    def _call(self, inputs: list[grpcclient.InferInput], timeout_s: float) -> dict[str, Any]:
        try:
            result = self._client.infer(MODEL, inputs, client_timeout=timeout_s)
        except InferenceServerException as exc:
            raise VoiceError(classify(str(exc.message()), exc.status())) from None
        return result_of(result)

    def register(
        self, name: str, transcript: str, audio: bytes, timeout_s: float = REGISTER_TIMEOUT_S
    ) -> dict[str, Any]:
        """The stored voice's summary (id, transcript, duration_s, frames, codes, codec, seconds)."""
        return self._call(voice_inputs("register", name, transcript, audio), timeout_s)

    def list(self, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Built-in voices (`builtin` true) and registered ones."""
        return list(self._call(voice_inputs("list"), timeout_s)["voices"])

    def delete(self, name: str, timeout_s: float = 30.0) -> None:
        self._call(voice_inputs("delete", name), timeout_s)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> VoiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
