"""Which registered voices this gateway's sessions speak with now, so a deletion waits for them.

A session (an HTTP request, a WebSocket) names its voice once and speaks one segment after another,
each its own request to the unit, which reads the voice store per request. A voice deleted at once
would fail every later segment of the sessions speaking with it (before: a 4,096-character response
ended at 11.8 % of its audio). So `DELETE /v1/voices/{name}` of a voice a session of this gateway
holds is answered at once (200, the voice is gone for new sessions: `hold` refuses it) and carried
out when the last such session ends (`release`); a registration of that name meanwhile is 409.
What this does not cover: a deletion sent to the unit past this gateway (gRPC, another gateway
process) applies at once; a gateway stopped before the last session ends leaves the voice in place.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from tandem.gateway.errors import ClientCode
from tandem.gateway.stream import refuse


class VoiceUsers:
    """Sessions per voice name and the deletions waiting for them. Event-loop only."""

    def __init__(self) -> None:
        self.sessions: collections.Counter[str] = collections.Counter()
        self.doomed: dict[str, Callable[[], None]] = {}  # name -> the deletion to run once free

    def hold(self, voice: str) -> Callable[[], None]:
        """Count a session speaking with `voice`; the returned function ends it (once). Refuses a
        voice whose deletion waits (400 `voice`)."""
        if voice in self.doomed:
            raise refuse(ClientCode.INVALID_ARG, f"voice {voice!r} is deleted", "voice")
        self.sessions[voice] += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.sessions[voice] -= 1
            if self.sessions[voice] <= 0:
                del self.sessions[voice]
                delete = self.doomed.pop(voice, None)
                if delete is not None:
                    delete()

        return release

    def defer_delete(self, voice: str, delete: Callable[[], None]) -> bool:
        """Run `delete` once no session holds `voice`: True when it waits, False when none holds it
        (the caller deletes now)."""
        if self.sessions[voice] <= 0:
            self.sessions.pop(voice, None)
            return False
        self.doomed[voice] = delete
        return True

    def deleting(self, voice: str) -> bool:
        return voice in self.doomed
