"""`tandem-unit`'s calls to its server's HTTP API: the repository index, a model's config, load, unload.

The model-repository API is locked with the unit's key (`serving/api_key.py`); every call here
carries it. Errors are `ControlError` (the server's answer, or why there was none). Nothing here
imports Triton or torch.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any


class ControlError(Exception):
    """A control call failed: `status` is the HTTP status (None when the server did not answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ControlApi:
    def __init__(self, base: str, headers: Mapping[str, str]) -> None:
        self.base = base  # http://host:port
        self.headers = dict(headers)

    def _call(self, method: str, path: str, body: Any, timeout_s: float) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path,
            data=data,
            method=method,
            headers={**self.headers, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return bytes(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, AttributeError):
                detail = str(json.loads(detail).get("error", detail))
            raise ControlError(f"{method} {path}: {exc.code} {detail.strip()}", exc.code) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ControlError(f"{method} {path}: {exc}") from None

    def index(self, timeout_s: float = 10.0) -> dict[str, tuple[str, str]]:
        """{model: (state, reason)} of the repository's models (Triton's repository index)."""
        raw = self._call("POST", "/v2/repository/index", {}, timeout_s)
        try:
            return {
                str(m.get("name")): (str(m.get("state", "")), str(m.get("reason", "")))
                for m in json.loads(raw)
            }
        except (ValueError, AttributeError) as exc:
            raise ControlError(f"the repository index does not parse: {exc}") from None

    def config(self, model: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """The model's config as the server runs it (JSON)."""
        try:
            out = json.loads(self._call("GET", f"/v2/models/{model}/config", None, timeout_s))
        except ValueError as exc:
            raise ControlError(f"{model}'s config does not parse: {exc}") from None
        if not isinstance(out, dict):
            raise ControlError(f"{model}'s config is not an object")
        return out

    def load(self, model: str, parameters: Mapping[str, Any] | None = None, timeout_s: float = 600.0) -> None:
        """Load `model` (with the repository API's load parameters, e.g. `config`); returns when the
        server answers, i.e. once the load ended."""
        body = {"parameters": dict(parameters)} if parameters else {}
        self._call("POST", f"/v2/repository/models/{model}/load", body, timeout_s)

    def unload(self, model: str, timeout_s: float = 30.0) -> None:
        self._call("POST", f"/v2/repository/models/{model}/unload", {}, timeout_s)

    def server_ready(self, timeout_s: float = 2.0) -> bool:
        """`/v2/health/ready` (Triton answers 200 ready, 400 not)."""
        try:
            self._call("GET", "/v2/health/ready", None, timeout_s)
        except ControlError as exc:
            if exc.status is None:
                raise
            return False
        return True
