"""P's offer lifecycle: the open offers, the recently ended ones, and every state change.

Who calls: `TransferSender` (the engine's thread), `SenderLoop` (accept and reader threads) and
`Copier` (copy workers), holding `lock` unless a method says otherwise; engine callbacks they
decide go to an `Actions` list run after the lock is released. Memory: P's source pages of an offer
belong to the sender from `offer()` until `on_source_released(tid)`, called exactly once (after the
gather or write, or when the offer is tombstoned). Failure: a tombstoned offer (ABORTED/EXPIRED)
ended before any write; its id in `recent` is the proof that no copy for it will start.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ._actions import Actions
from ._offer import Offer
from .state import OfferState, SenderStats, TransferEvent

_RECENT_MAX = 4096


class OfferBook:
    """Every field is read and written under `lock` only (methods: the caller holds it, unless noted)."""

    def __init__(
        self,
        path_name: str,
        on_source_released: Callable[[str], None],
        on_fatal: Callable[[str], None],
        on_event: Callable[[TransferEvent], None] | None,
        max_held_acks: int,
        max_hold_s: float | None,
    ) -> None:
        self.lock = threading.Lock()
        self.offers: dict[str, Offer] = {}
        self.recent: OrderedDict[str, OfferState] = OrderedDict()
        self.closing = False
        self.fatal = False
        self._path_name = path_name
        self._on_source_released = on_source_released
        self._on_fatal = on_fatal
        self.on_event = on_event
        self._max_held = max_held_acks
        self._max_hold_s = max_hold_s
        self.counts = dict.fromkeys(
            (
                "offers_total",
                "copies_ok",
                "copies_failed",
                "pulls_refused",
                "offers_expired",
                "offers_aborted",
                "bytes_moved",
                "acks_sent",
                "auth_failures",
                "offers_dropped",
                "drops_refused",
            ),
            0,
        )

    def tombstone(self, offer: Offer, state: OfferState, actions: Actions) -> None:
        """End an offer before any write: from now on no copy for it can start."""
        self.counts["offers_expired" if state is OfferState.EXPIRED else "offers_aborted"] += 1
        self.finish(offer, state)
        if not offer.source_released:
            offer.source_released = True
            actions.append(lambda: self._on_source_released(offer.tid))
        if self.on_event is not None:
            event, cb = self.event(offer, state.name), self.on_event
            actions.append(lambda: cb(event))

    def finish(self, offer: Offer, state: OfferState) -> None:
        offer.state = state
        self.offers.pop(offer.tid, None)
        self.recent[offer.tid] = state
        while len(self.recent) > _RECENT_MAX:
            self.recent.popitem(last=False)

    def release_source(self, offer: Offer) -> None:
        """Without the lock held (a copy worker, after the gather): exactly-once source release."""
        with self.lock:
            if offer.source_released:
                return
            offer.source_released = True
        self._on_source_released(offer.tid)

    def held_count(self) -> int:
        """Offers whose ABORT_ACK waits for their copy to return."""
        return sum(1 for o in self.offers.values() if o.abort_waiters)

    def too_many_held(self, actions: Actions) -> None:
        """After an ACK was held: `max_held_acks` held at once makes P fatal."""
        if self.held_count() >= self._max_held:
            self.go_fatal(f"{self.held_count()} ABORT_ACKs held (copies not finishing)", actions)

    def go_fatal(self, reason: str, actions: Actions) -> None:
        """P cannot prove its copies over: `on_fatal` (the engine exits; its restart is D's proof)."""
        if not self.fatal:
            self.fatal = True
            actions.append(lambda: self._on_fatal(reason))

    def housekeeping(self, actions: Actions) -> None:
        """Expire unpulled offers past their TTL; an ACK held over `max_hold_s` makes P fatal."""
        now = time.monotonic()
        for offer in list(self.offers.values()):
            if offer.state is OfferState.OFFERED and now > offer.expires:
                self.tombstone(offer, OfferState.EXPIRED, actions)
            elif (
                offer.abort_waiters
                and self._max_hold_s is not None
                and now - offer.held_since > self._max_hold_s
            ):
                self.go_fatal(f"ABORT_ACK for {offer.tid} held over {self._max_hold_s}s", actions)

    def event(self, offer: Offer, error: str | None) -> TransferEvent:
        return TransferEvent(
            offer.tid,
            offer.nbytes,
            offer.state.name,
            error,
            self._path_name,
            copy_start_ns=offer.copy_start_ns,
            copy_end_ns=offer.copy_end_ns,
        )

    def stats(self, connections: int) -> SenderStats:
        return SenderStats(
            offers_open=len(self.offers), held_acks=self.held_count(), connections=connections, **self.counts
        )
