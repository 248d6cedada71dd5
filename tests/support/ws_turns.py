"""Reading the stream-input WebSocket's turns in tests (`gateway/ws.py`)."""

from __future__ import annotations

import json
from typing import Any

from websockets.sync.client import ClientConnection


def until_turn_done(ws: ClientConnection, timeout: float = 120.0) -> tuple[bytes, dict[str, Any], list[dict]]:
    """(the turn's binary audio, its turn_done, the other events) once the next turn_done arrives."""
    audio, events = bytearray(), []
    while True:
        msg = ws.recv(timeout=timeout)
        if isinstance(msg, bytes):
            audio += msg
            continue
        event = json.loads(msg)
        if event["type"] == "turn_done":
            return bytes(audio), event, events
        events.append(event)
