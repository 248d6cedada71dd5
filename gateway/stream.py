"""The gateway's Triton side: which models it serves, how a speech request becomes `tts` inputs, and
one gRPC stream per request with its audio yielded as it arrives.

Who calls: `gateway/app.py` (the HTTP routes), `bench/gateway.py` and the tests. One
`tritonclient.grpc.aio` client per gateway process; every request opens its own bidirectional stream
(`stream_infer`) carrying exactly one Triton request with a stream id (`sequence_id`) the gateway
picks, `sequence_start` and `sequence_end` set. The request side of the stream stays open until the
final response has arrived, and closing the generator `stream_audio` returns (the HTTP caller hung
up) cancels the gRPC call, which Triton passes on to the engines as a cancelled request.

Text: OpenAI's `input` (text) goes to the model's `TEXT` BYTES [1] input and `voice` to `VOICE` BYTES
[1] (and to `VOICE_ID`, the affinity and metrics label). `text_inputs` is that mapping; a model that
publishes no `TEXT` input (read from its config at start-up) gets no tokenizer of ours in its place:
the request is refused with INVALID_ARG. `prompt_inputs` builds a request from prompt rows instead,
for callers inside the process (tests, the bench), never from HTTP. No `MAX_TOKENS` is sent: an HTTP
request streams the model's default length (`tandem.limits.default_new_rows`).

Errors the model reports name the Triton input first (`VOICE 'alloy' is not one of this model's
voices: ...`, `TEXT makes 4097 prompt rows; ...`); `openai_param` turns that name into the OpenAI
field the caller sent (`voice`, `input`), the error's `param`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aio

from tandem.gateway.client import build_inputs, scalar_input
from tandem.gateway.errors import ClientCode, ClientError, classify
from tandem.wire import contract as wire

TEXT, VOICE, VOICE_ID = wire.TEXT.name, wire.VOICE.name, wire.VOICE_ID.name
DECODE = wire.DECODE.name  # D's model: the `tts` step that takes CANCEL directly
OPENAI_PARAMS = {
    TEXT: "input",
    VOICE: "voice",
    VOICE_ID: "voice",
    wire.SEED.name: "seed",
}  # Triton input -> the body's field


class GatewayError(Exception):
    """A request the gateway cannot serve; `error` is what the caller is told."""

    def __init__(self, error: ClientError, param: str | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.param = param


def refuse(code: ClientCode, detail: str, param: str | None = None) -> GatewayError:
    return GatewayError(ClientError(code, detail), param)


@dataclass(frozen=True)
class SpeechModel:
    """What the gateway knows of one served model, read from its config once at start-up."""

    name: str
    sample_rate: int
    row_width: int
    inputs: frozenset[str]
    path: frozenset[str] = frozenset()  # the model and, for an ensemble, the models of its steps
    voices: tuple[str, ...] = ()  # built-in voices in their configured order (none: any, or no list)

    @property
    def takes_text(self) -> bool:
        return TEXT in self.inputs

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SpeechModel:
        """`config`: the model's config as JSON (`get_model_config(..., as_json=True)["config"]`)."""
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        name = str(config["name"])
        outputs = {o["name"] for o in config.get("output", [])}
        if wire.AUDIO.name not in outputs or "sample_rate" not in params:
            raise ValueError(f"model {name!r} is not a tandem speech model (no AUDIO output / sample_rate)")
        return cls(
            name=name,
            sample_rate=int(params["sample_rate"]),
            row_width=int(params.get("row_width", "1")),
            inputs=frozenset(i["name"] for i in config.get("input", [])),
            path=frozenset(
                {name}
                | {str(s["model_name"]) for s in (config.get("ensemble_scheduling") or {}).get("step", [])}
            ),
        )


VOICES_PARAM = "tandem.frontend.voices"


def _voices(config: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The built-in voices a config lists (None: it lists none; `*`, any voice, lists none either)."""
    raw = ((config.get("parameters") or {}).get(VOICES_PARAM) or {}).get("string_value")
    if raw is None:
        return None
    voices = tuple(v.strip() for v in raw.split(",") if v.strip())
    return () if "*" in voices else voices


async def discover(client: aio.InferenceServerClient, names: tuple[str, ...]) -> dict[str, SpeechModel]:
    """Each named model's config (and, for an ensemble, its steps' built-in voices); raises
    (tritonclient's exception) while Triton cannot answer."""
    out = {}
    for name in names:
        config = (await client.get_model_config(name, as_json=True))["config"]
        model = SpeechModel.from_config(config)
        voices = _voices(config)
        for step in sorted(model.path - {name}) if voices is None else ():
            voices = _voices((await client.get_model_config(step, as_json=True))["config"])
            if voices is not None:
                break
        out[name] = dataclasses.replace(model, voices=voices or ())
    return out


PROMPT_ROWS = "prompt_rows"  # the final TIMINGS' count of prompt rows (backend/timing.py's key)


def _prompt_rows(timings: np.ndarray | None) -> int:
    """The prompt's rows a final response's `TIMINGS` carries (0 when it carries none)."""
    if timings is None or not timings.size:
        return 0
    raw = timings.reshape(-1)[0]
    try:
        stamps = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw) or "{}")
    except ValueError:
        return 0
    value = stamps.get(PROMPT_ROWS, 0) if isinstance(stamps, dict) else 0
    return value if isinstance(value, int) else 0


def text_inputs(
    model: SpeechModel, text: str, voice: str, seed: int | None = None
) -> list[grpcclient.InferInput]:
    """OpenAI's `input` and `voice` (and tandem's `seed`, to `SEED`) as `model`'s inputs. Raises
    GatewayError (INVALID_ARG) when the model takes no text."""
    if not model.takes_text:
        raise refuse(
            ClientCode.INVALID_ARG,
            f"model {model.name!r} takes no text: it publishes no {TEXT} input (serve a repository with "
            "a text front end, e.g. the Orpheus one)",
            "input",
        )
    if not text.strip():
        raise refuse(ClientCode.INVALID_ARG, "input is empty", "input")
    inputs = [scalar_input(wire.TEXT, text)]
    if VOICE in model.inputs:
        inputs.append(scalar_input(wire.VOICE, voice))
    if VOICE_ID in model.inputs:
        inputs.append(scalar_input(wire.VOICE_ID, voice))
    if seed is not None:
        inputs.append(scalar_input(wire.SEED, seed))
    return inputs


def prompt_inputs(prompt: np.ndarray, **params: Any) -> list[grpcclient.InferInput]:
    """Prompt rows (INT64 [N, W]) and the optional inputs of the client contract, for callers inside
    the process; HTTP callers always send text."""
    return build_inputs(prompt, **params)


def openai_param(error: ClientError) -> str | None:
    """The OpenAI body field an error of the model is about: its detail's first word names the
    Triton input (`backend/prompt.py`, `backend/text/frontend.py`); None when it names none of ours."""
    first = error.detail.split(" ", 1)[0] if error.code is ClientCode.INVALID_ARG else ""
    return OPENAI_PARAMS.get(first)


def new_stream_id() -> int:
    """A random non-zero 63-bit id: unique across gateway processes sharing one server."""
    return secrets.randbelow(2**63 - 1) + 1


@dataclass(frozen=True)
class AudioPiece:
    """One response's audio: float32 PCM in [-1, 1] and the rows it was made of; on the stream's
    last piece, its prompt's rows (`PROMPT_ROWS`, from the final `TIMINGS`; 0 elsewhere
    or when the unit did not say)."""

    pcm: np.ndarray
    rows: int
    prompt_rows: int = 0


@dataclass(frozen=True)
class StreamRequest:
    model: str
    inputs: list[grpcclient.InferInput]
    stream_id: int


async def cancel_on_decode(client: aio.InferenceServerClient, stream_id: int, timeout_s: float = 5.0) -> None:
    """Tell D to drop `tts` stream `stream_id`: one request to `decode` with `CANCEL` (Triton 2.51 does
    not pass an ensemble's cancellation on to its decode step; serving/cancel_board.py). Raises
    GatewayError when D refuses it or does not answer within `timeout_s`."""
    cancel = scalar_input(wire.CANCEL, stream_id)
    answered = asyncio.Event()

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {
            "model_name": DECODE,
            "inputs": [cancel],
            "request_id": f"cancel-{stream_id}",
            "sequence_id": new_stream_id(),
            "sequence_start": True,
            "sequence_end": True,
        }
        await answered.wait()

    responses = client.stream_infer(requests())
    try:
        _, error = await asyncio.wait_for(responses.__anext__(), timeout_s)
    except asyncio.TimeoutError:
        raise refuse(ClientCode.UNAVAILABLE, f"decode did not answer CANCEL in {timeout_s:g} s") from None
    except grpc.RpcError as exc:
        raise GatewayError(classify(str(exc.details()), str(exc.code()))) from None
    finally:
        answered.set()
        responses.cancel()
    if error is not None:
        raise GatewayError(classify(error.message() or str(error), error.status()))


# Why a silent stream is lost: None, or what the unit says of a model on its path (a dead stub).
LostCheck = Callable[[], Awaitable[str | None]]
LOST_POLL_S = 1.0  # how often a stream silent past `lost_after_s` asks `lost` again


async def stream_audio(
    client: aio.InferenceServerClient,
    req: StreamRequest,
    idle_timeout_s: float = 60.0,
    lost: LostCheck | None = None,
    lost_after_s: float = 5.0,
    abandoned: Callable[[int], None] | None = None,
) -> AsyncGenerator[AudioPiece, None]:
    """Yields each response's audio as it arrives and returns after Triton's final response.

    Raises GatewayError on an error response (code by `classify`), on a broken stream (its gRPC
    status), or when no response arrives for `idle_timeout_s` (UNAVAILABLE). A stream silent for
    `lost_after_s` asks `lost` (then every LOST_POLL_S): a reason ends it at once (UNAVAILABLE), since
    Triton never answers the requests a dead stub held. Closing the generator before the end
    cancels the gRPC call (Triton marks the request cancelled; the engines stop). A stream that ends
    any way but with its final response calls `abandoned(stream_id)` (the gateway tells D, which an
    ensemble's cancellation does not reach)."""
    finished = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {
            "model_name": req.model,
            "inputs": req.inputs,
            "request_id": str(req.stream_id),
            "sequence_id": req.stream_id,
            "sequence_start": True,
            "sequence_end": True,
        }
        await finished.wait()  # half-closing the stream early would end it before the last response

    async def silence_ends(pending: asyncio.Future[Any]) -> None:
        """Returns once `pending` has its response; raises when the silence has a verdict."""
        since = loop.time()
        while True:
            silent = loop.time() - since
            if silent >= idle_timeout_s:
                raise refuse(ClientCode.UNAVAILABLE, f"no response from Triton for {idle_timeout_s:g} s")
            step = idle_timeout_s - silent
            if lost is not None:
                step = min(step, max(lost_after_s - silent, LOST_POLL_S))
            if (await asyncio.wait({pending}, timeout=step))[0]:
                return
            if lost is not None and loop.time() - since >= lost_after_s and (reason := await lost()):
                if pending.done():  # the response came while the unit's health was read
                    return
                raise refuse(
                    ClientCode.UNAVAILABLE,
                    f"the stream is lost: no response for {loop.time() - since:.1f} s and {reason}"
                    " (tandem-unit reloads it; send the request again)",
                )

    responses = client.stream_infer(requests())
    done = completed = False  # completed: the final response came, or a refusal that reached no engine
    pending: asyncio.Future[Any] | None = None
    try:
        while not done:
            pending = asyncio.ensure_future(responses.__anext__())
            await silence_ends(pending)
            try:
                result, error = pending.result()
            except StopAsyncIteration:
                raise refuse(
                    ClientCode.UNAVAILABLE, "Triton closed the stream before its final response"
                ) from None
            except grpc.RpcError as exc:  # the stream itself broke: its status is the code
                raise GatewayError(classify(str(exc.details()), str(exc.code()))) from None
            if error is not None:
                done = True
                refused = classify(error.message() or str(error), error.status())
                completed = refused.code in (ClientCode.INVALID_ARG, ClientCode.NOT_FOUND)
                raise GatewayError(refused, openai_param(refused))
            params = result.get_response().parameters
            done = "triton_final_response" in params and params["triton_final_response"].bool_param
            audio = result.as_numpy(wire.AUDIO.name)
            tokens = result.as_numpy(wire.TOKENS.name)
            completed = done
            prompt_rows = _prompt_rows(result.as_numpy(wire.TIMINGS.name)) if done else 0
            if (audio is not None and audio.size) or prompt_rows:
                empty = audio is None or not audio.size
                pcm = np.zeros(0, np.float32) if empty else audio
                yield AudioPiece(pcm, 0 if tokens is None else int(tokens.shape[0]), prompt_rows)
    finally:
        finished.set()
        if pending is not None and not pending.done():
            pending.cancel()
        if not done:
            responses.cancel()
        if not completed and abandoned is not None:
            abandoned(req.stream_id)
