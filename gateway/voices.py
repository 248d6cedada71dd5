"""The gateway's voice routes: register a voice from a reference recording, list, delete.

- `POST /v1/voices` (multipart/form-data: `name`, `transcript`, `file` — the recording, any format
  FFmpeg reads): 201 with the stored voice (`id`, `transcript`, `duration_s`, `frames`, `codes`,
  `codec`, `created`, `seconds`: decode/encode/store times). The unit encodes the reference once
  with the codec's own encoder (seconds per second of audio on a CPU), so the answer takes that long.
- `GET /v1/voices` (and `GET /v1/audio/voices`, the path vLLM-Omni's clients ask): OpenAI-style
  list of the model's built-in voices (`builtin` true, each with the OpenAI names that speak it:
  `aliases`, `gateway/aliases.py`) and the registered ones (`builtin` false).
- `GET /v1/voices/{name}`: one of them (404 NOT_FOUND when there is none).
- `DELETE /v1/voices/{name}`: 200 `{"id", "object": "voice", "deleted": true}`. A voice that
  sessions of this gateway speak with is gone for new sessions at once and deleted on the unit when
  the last of them ends (`gateway/voice_users.py`), so a response speaking with it is not cut.

Every error is the gateway's OpenAI error JSON (`app.error_response`), `param` the form field:
400 INVALID_ARG (a field missing or malformed, not audio, too short or long, a built-in name or an alias),
409 ALREADY_EXISTS (the name is taken), 404 NOT_FOUND (no such registered voice, or the unit serves
no `voices` model), 503 UNAVAILABLE. The Triton side is the `voices` model (`gateway/voice_client.py`
builds its inputs); its refusals name NAME, TRANSCRIPT, AUDIO, here `name`, `transcript`, `file`.

Size: a body whose Content-Length exceeds the model's `tandem.voices.max_file_bytes` plus
`FORM_SLACK` is refused (400, `file`) before it is read; a chunked body is cut at the same size as
it arrives (400, `file`: `_capped`; the file parts read until then are spooled to disk and
removed); `UPLOAD_CEILING` (413, the route's `max_body_size`) is the backstop the gateway checks
before the model's limit is known (`gateway/limits.py`); the file itself is checked again as read.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

import tritonclient.grpc.aio as aio
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException
from starlette.types import Message, Receive
from tritonclient.utils import InferenceServerException

from tandem.gateway.aliases import OPENAI_VOICES
from tandem.gateway.errors import ClientCode, ClientError, classify
from tandem.gateway.stream import GatewayError, refuse
from tandem.gateway.tenants import OPEN, Tenant, own_name, voice_id
from tandem.gateway.voice_client import MODEL, REGISTER_TIMEOUT_S, result_of, voice_inputs
from tandem.wire import contract as wire

FORM_SLACK = 64 * 1024  # the form's other fields and multipart framing
UPLOAD_CEILING = 64 * 2**20
# `voices` input -> the form's field
FORM_PARAMS = {wire.NAME.name: "name", wire.TRANSCRIPT.name: "transcript", wire.REFERENCE.name: "file"}
CALL_TIMEOUT_S = 30.0
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a caller's voice name (the store's, without a namespace)

router = APIRouter()
log = logging.getLogger("tandem.gateway")
_LATER: set[asyncio.Task[None]] = set()  # deferred deletions in flight (kept from the GC)


@dataclass(frozen=True)
class VoiceLimits:
    """What the gateway checks itself, read from the `voices` model's config once."""

    max_file_bytes: int


@dataclass
class VoiceRoutes:
    """The routes' state on `app.state.voices`: the limits, once the `voices` model answered."""

    limits: VoiceLimits | None = None


def install(app: FastAPI) -> None:
    """Add the voice routes to the gateway's app (`gateway/app.py` calls this once)."""
    app.state.voices = VoiceRoutes()
    app.include_router(router)


def _client(request: Request) -> aio.InferenceServerClient:
    client = request.app.state.gateway.client
    if client is None:
        raise refuse(ClientCode.UNAVAILABLE, "the gateway is starting")
    return client


async def _call(request: Request, inputs: list[Any], timeout_s: float, tenant: str = OPEN) -> dict[str, Any]:
    """The `voices` model's answer; its refusal as a GatewayError naming the form field, the
    voice named as `tenant` names it."""
    try:
        result = await _client(request).infer(MODEL, inputs, client_timeout=timeout_s)
    except InferenceServerException as exc:
        error = classify(str(exc.message()), exc.status())
        first = error.detail.split(" ", 1)[0]
        if tenant:  # the unit names the stored voice, `'acme.bob'`: the caller named it `'bob'`
            error = ClientError(error.code, error.detail.replace(f"'{tenant}.", "'"))
        raise GatewayError(error, FORM_PARAMS.get(first)) from None
    return result_of(result)


async def _limits(request: Request) -> VoiceLimits:
    routes: VoiceRoutes = request.app.state.voices
    limits = routes.limits
    if limits is None:
        try:
            cfg = await _client(request).get_model_config(MODEL, as_json=True)
        except InferenceServerException as exc:
            raise GatewayError(classify(str(exc.message()), exc.status())) from None
        params = cfg["config"].get("parameters") or {}
        raw = params.get("tandem.voices.max_file_bytes", {}).get("string_value") or str(16 * 2**20)
        limits = VoiceLimits(int(raw))
        routes.limits = limits
    return limits


def _card(voice: dict[str, Any], name: str) -> dict[str, Any]:
    """The unit's `voice` as the caller sees it, `id` its own `name` for it."""
    return {**voice, "id": name, "object": "voice"}


def _check_name(name: object) -> str:
    """A caller's voice name: `[A-Za-z0-9_-]{1,64}` (the unit adds the tenant's namespace)."""
    if not isinstance(name, str) or not name:
        raise refuse(ClientCode.INVALID_ARG, "name is required (a form field)", "name")
    if not NAME.fullmatch(name):
        raise refuse(
            ClientCode.INVALID_ARG,
            f"name {name[:80]!r} is not a voice name: 1-64 of A-Z, a-z, 0-9, '_' and '-'",
            "name",
        )
    return name


class _OverLimit(Exception):
    """A chunked body went past what the `voices` model takes."""


def _capped(receive: Receive, limit: int) -> Receive:
    """`receive`, raising `_OverLimit` once more than `limit` body bytes came."""
    seen = 0

    async def capped() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise _OverLimit
        return message

    return capped


@router.post("/v1/voices", status_code=201, max_body_size=UPLOAD_CEILING)
async def register(request: Request, tenant: Tenant) -> JSONResponse:
    limits = await _limits(request)
    users = request.app.state.gateway.voice_users
    length = request.headers.get("content-length", "")
    body_limit = limits.max_file_bytes + FORM_SLACK
    if length.isdigit() and int(length) > body_limit:
        raise refuse(
            ClientCode.INVALID_ARG,
            f"file: the request is {int(length)} bytes; a reference file may be {limits.max_file_bytes}",
            "file",
        )
    try:
        capped = Request(request.scope, _capped(request.receive, body_limit))
        form = await capped.form(max_files=1, max_fields=2, max_part_size=FORM_SLACK)
    except _OverLimit:
        raise refuse(
            ClientCode.INVALID_ARG,
            f"file: the request is over {body_limit} bytes; a reference file may be {limits.max_file_bytes}",
            "file",
        ) from None
    except MultiPartException as exc:
        raise refuse(ClientCode.INVALID_ARG, f"the form (multipart: name, transcript, file): {exc}") from None
    try:
        name, transcript, upload = _check_name(form.get("name")), form.get("transcript"), form.get("file")
        if not isinstance(transcript, str) or not transcript.strip():
            raise refuse(
                ClientCode.INVALID_ARG, "transcript is required: what the recording says", "transcript"
            )
        if not isinstance(upload, UploadFile):
            raise refuse(
                ClientCode.INVALID_ARG, "file is required: the reference recording (a file part)", "file"
            )
        data = await upload.read(limits.max_file_bytes + 1)
        if len(data) > limits.max_file_bytes:
            raise refuse(
                ClientCode.INVALID_ARG, f"file is over the limit of {limits.max_file_bytes} bytes", "file"
            )
    finally:
        await form.close()
    if request.app.state.gateway.settings.aliases.is_voice_alias(name):
        raise refuse(
            ClientCode.INVALID_ARG,
            f"name {name!r} is an alias of a built-in voice (see GET /v1/voices); choose another name",
            "name",
        )
    stored = voice_id(tenant, name)
    if users.deleting(stored):
        raise refuse(
            ClientCode.ALREADY_EXISTS,
            f"name: {name!r} is being deleted once the requests speaking with it end; retry then",
            "name",
        )
    result = await _call(
        request, voice_inputs("register", stored, transcript, data), REGISTER_TIMEOUT_S, tenant
    )
    return JSONResponse(_card(result, name), status_code=201)


async def _cards(request: Request, tenant: str) -> list[dict[str, Any]]:
    """The built-in voices and `tenant`'s registered ones."""
    result = await _call(request, voice_inputs("list"), CALL_TIMEOUT_S)
    cards = []
    for v in result["voices"]:
        name = v["id"] if v.get("builtin") else own_name(tenant, v["id"])
        if name is not None:
            cards.append(_card(v, name))
    builtin = tuple(c["id"] for c in cards if c.get("builtin"))
    aliases = request.app.state.gateway.settings.aliases
    for card in cards:
        if card.get("builtin"):
            card["aliases"] = [
                a
                for a in (tuple(aliases.voices) or OPENAI_VOICES)
                if aliases.voice(a, builtin) == card["id"] != a
            ]
    return cards


@router.get("/v1/voices")
@router.get("/v1/audio/voices")
async def list_voices(request: Request, tenant: Tenant) -> dict[str, Any]:
    return {"object": "list", "data": await _cards(request, tenant)}


@router.get("/v1/voices/{name}")
async def get_voice(request: Request, name: str, tenant: Tenant) -> dict[str, Any]:
    for card in await _cards(request, tenant):
        if card["id"] == name:
            return card
    raise refuse(
        ClientCode.NOT_FOUND, f"name: {name!r} is not a voice here (GET /v1/voices lists them)", "name"
    )


@router.delete("/v1/voices/{name}")
async def delete(request: Request, name: str, tenant: Tenant) -> dict[str, Any]:
    gateway = request.app.state.gateway
    users = gateway.voice_users
    stored = voice_id(tenant, _check_name(name))
    if users.deleting(stored):
        raise refuse(ClientCode.NOT_FOUND, f"name: {name!r} is not a registered voice (deleted)", "name")
    if users.sessions[stored] > 0:
        listed = await _call(request, voice_inputs("list"), CALL_TIMEOUT_S)
        registered = {v["id"] for v in listed["voices"] if not v.get("builtin")}
        if stored in registered:  # else the unit's own refusal below (a built-in or unknown name)
            users.defer_delete(stored, lambda: _delete_later(gateway, stored))
            return {"id": name, "object": "voice", "deleted": True}
    await _call(request, voice_inputs("delete", stored), CALL_TIMEOUT_S, tenant)
    return {"id": name, "object": "voice", "deleted": True}


def _delete_later(gateway: Any, name: str) -> None:
    """The deletion the last session speaking with `name` leaves behind, in the background."""
    client = gateway.client

    async def run() -> None:
        try:
            await client.infer(MODEL, voice_inputs("delete", name), client_timeout=CALL_TIMEOUT_S)
            log.info("gateway: voice %r deleted once its last session ended", name)
        except Exception as exc:  # the unit is gone or the voice was deleted past this gateway
            log.warning("gateway: voice %r: the deferred deletion failed: %s", name, exc)

    task = asyncio.get_running_loop().create_task(run())
    _LATER.add(task)
    task.add_done_callback(_LATER.discard)
