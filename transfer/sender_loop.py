"""P's connection loop: the accept/housekeeping thread and one reader thread per D connection.

Who calls: `TransferSender.start` hands it the bound listener; `close` shuts the connections down.
The accept thread admits only this unit's D (unix: peer uid; tcp: at most `_MAX_HANDSHAKES`
unauthenticated peers, then the unit-secret handshake) and runs `OfferBook.housekeeping` every
~50 ms. A reader checks the HELLO (`pull_checks`), maps D's arena, and turns PULL/PULL_ROWS, ABORT,
DROP and PING into offer transitions: an accepted PULL goes to the `Copier`, a refused one gets
FAILED at once (tombstoning the offer where that is proof). Memory: a peer's arena mapping lives
while a copy still references it, after its connection ends.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from ._actions import Actions, run
from ._conn import Connection, accepted
from ._offer import Peer
from .auth import AuthFailed, accept_handshake
from .control import CONTROL_MAGIC, CONTROL_ROLES, same_user
from .copier import Copier
from .errors import ProtocolError, TransferError
from .frames import PROTOCOL_VERSION, FailReason, MsgType
from .layout import WireLayout
from .offers import OfferBook
from .paths.base import TransferPath
from .pull_checks import bad_dst, hello_refusal
from .state import OfferState

log = logging.getLogger(__name__)
_MAX_HANDSHAKES = 16  # tcp control: connections still proving themselves; more are closed at once


class SenderLoop:
    """The threads that serve D connections for one sender."""

    def __init__(
        self,
        book: OfferBook,
        copier: Copier,
        *,
        layout: WireLayout,
        path: TransferPath,
        instance_id: str,
        control: str,
        secret: bytes | None,
    ) -> None:
        self._book = book
        self._copier = copier
        self._layout = layout
        self._path = path
        self._instance_id = instance_id
        self._control = control
        self._secret = secret
        self._handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)  # tcp: unauthenticated peers
        self._peers: set[Peer] = set()  # under the book's lock
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._server: socket.socket | None = None

    @property
    def connections(self) -> int:
        """Book lock held."""
        return len(self._peers)

    def start(self, server: socket.socket) -> None:
        self._server = server
        self._spawn(self._accept_loop, "tandem-p-accept")

    def stop_accepting(self) -> None:
        """The accept thread (and its housekeeping) ends on its next tick."""
        self._stop.set()

    def close(self) -> None:
        """After `stop_accepting`: shut every connection down, wait for the threads."""
        with self._book.lock:
            peers = list(self._peers)
        for peer in peers:
            peer.conn.shutdown()
        for t in self._threads:
            t.join(2.0)

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]  # connections come and go
        return t

    def _housekeeping(self) -> None:
        actions: Actions = []
        with self._book.lock:
            self._book.housekeeping(actions)
        run(actions)

    def _accept_loop(self) -> None:
        assert self._server is not None
        for sock in accepted(self._server, self._stop, self._housekeeping):
            if self._control == "unix" and not same_user(sock):
                sock.close()
                continue
            if self._control == "tcp" and not self._handshakes.acquire(blocking=False):
                log.warning("refused a control connection from %s: too many handshakes", _peer_name(sock))
                sock.close()
                continue
            try:
                self._spawn(self._serve_connection, "tandem-p-conn", sock)
            except RuntimeError as exc:  # cannot start a thread: refuse this one, keep accepting
                log.error("refused a control connection: %s", exc)
                if self._control == "tcp":
                    self._handshakes.release()
                sock.close()

    def _serve_connection(self, sock: socket.socket) -> None:
        """One D connection: on TCP first the unit-secret handshake, then the protocol (`_read_loop`)."""
        if self._control == "tcp":
            try:
                accept_handshake(sock, self._secret or b"", CONTROL_MAGIC, CONTROL_ROLES)
            except (AuthFailed, OSError, EOFError) as exc:
                with self._book.lock:
                    self._book.counts["auth_failures"] += 1
                log.warning("refused a control connection from %s: %s", _peer_name(sock), exc)
                sock.close()
                return
            finally:
                self._handshakes.release()
        peer = Peer(Connection(sock))
        with self._book.lock:
            self._peers.add(peer)
        self._read_loop(peer)

    def _read_loop(self, peer: Peer) -> None:
        try:
            kind, msg, fds = peer.conn.reader.read()
            if kind is not MsgType.HELLO:
                raise ProtocolError(f"expected HELLO, got {kind.name}")
            if not self._hello(peer, msg, fds):
                return
            while True:
                kind, msg, _ = peer.conn.reader.read()
                if kind is MsgType.PULL or kind is MsgType.PULL_ROWS:
                    self._pull(peer, msg)
                elif kind is MsgType.ABORT:
                    self._abort(peer.conn, msg["tid"])
                elif kind is MsgType.DROP:
                    self._drop(msg)
                elif kind is MsgType.PING:
                    peer.conn.send(MsgType.PONG, nonce=msg["nonce"], instance=self._instance_id)
                else:
                    raise ProtocolError(f"unexpected {kind.name} from D")
        except (EOFError, OSError, ProtocolError):
            pass
        finally:
            with self._book.lock:
                self._peers.discard(peer)
            peer.conn.finish()  # the PeerArena mapping stays alive while a copy still references it

    def _hello(self, peer: Peer, msg: dict[str, object], fds: list[int]) -> bool:
        refusal = hello_refusal(msg, self._path, self._layout)
        if refusal is None:
            try:
                peer.arena = self._path.open_peer_arena(msg["arena"], fds)  # type: ignore[arg-type]
            except TransferError as exc:
                peer.conn.send(MsgType.FAILED, tid=None, reason=int(FailReason.BAD_REGION), detail=str(exc))
                return False
            return peer.conn.send(MsgType.HELLO_ACK, v=PROTOCOL_VERSION, instance=self._instance_id)
        for fd in fds:
            os.close(fd)
        reason, detail = refusal
        peer.conn.send(MsgType.FAILED, tid=None, reason=int(reason), detail=detail)
        return False

    def _pull(self, peer: Peer, msg: dict[str, object]) -> None:
        """A PULL (copy into D's region at `offset`) or a PULL_ROWS (write D's pool at the `dst` runs)."""
        book = self._book
        tid = str(msg["tid"])
        direct = "dst" in msg
        offset = 0 if direct else int(msg["offset"])  # type: ignore[call-overload]
        nbytes = int(msg["nbytes"])  # type: ignore[call-overload]
        remaining_s = float(msg["remaining_ms"]) / 1000.0  # type: ignore[arg-type]
        actions: Actions = []
        reason: FailReason | None = None
        dst: list[int] | None = None
        bad: str | None = None
        if direct:
            dst = msg["dst"]  # type: ignore[assignment]
            bad = bad_dst(self._layout, peer.arena, dst, nbytes)
            if bad is not None:
                log.warning("refused PULL_ROWS %s: %s", tid, bad)
        with book.lock:
            offer = book.offers.get(tid)
            if book.closing or book.fatal:
                reason = FailReason.CLOSING
            elif offer is None:
                past = book.recent.get(tid)
                refusals = {OfferState.EXPIRED: FailReason.EXPIRED, OfferState.ABORTED: FailReason.ABORTED}
                reason = refusals.get(past, FailReason.UNKNOWN) if past is not None else FailReason.UNKNOWN
            elif offer.state is not OfferState.OFFERED:
                reason = FailReason.UNKNOWN  # already pulled: only one PULL per offer
            elif direct and (offer.rows is None or not self._path.direct_write):
                reason = FailReason.NO_DIRECT
                book.tombstone(offer, OfferState.ABORTED, actions)  # D never pulls a tid twice
            elif (
                peer.arena is None
                or nbytes != offer.nbytes
                or not 0 <= offset <= peer.arena.nbytes - nbytes
                or (direct and bad is not None)
            ):
                reason = FailReason.BAD_REGION
                book.tombstone(offer, OfferState.ABORTED, actions)  # its pages need not wait for the TTL
            elif remaining_s <= 0:
                book.tombstone(offer, OfferState.EXPIRED, actions)  # refused before start: proof
                reason = FailReason.EXPIRED
            else:
                offer.state = OfferState.QUEUED
                offer.pull_peer, offer.pull_offset, offer.pull_dst = peer, offset, dst
                offer.pull_deadline = time.monotonic() + remaining_s
                self._copier.put(offer)
            if reason is not None:
                book.counts["pulls_refused"] += 1
        run(actions)
        if reason is not None:
            detail = f"{reason.name}: {bad}" if reason is FailReason.BAD_REGION and bad else reason.name
            peer.conn.send(MsgType.FAILED, tid=tid, reason=int(reason), detail=detail)

    def _abort(self, conn: Connection, tid: str) -> None:
        """ABORT: tombstone an offer not yet copying and ACK at once; during a copy the ACK is held
        until the copy returns (`Copier`), and too many held makes P fatal (`OfferBook`)."""
        book = self._book
        actions: Actions = []
        ack = True
        with book.lock:
            offer = book.offers.get(tid)
            if offer is not None and offer.state in (OfferState.OFFERED, OfferState.QUEUED):
                book.tombstone(offer, OfferState.ABORTED, actions)  # a queued job will skip it
            elif offer is not None and offer.state is OfferState.COPYING:
                ack = False  # no proof yet: the ACK goes out when the copy returns
                if not offer.abort_waiters:
                    offer.held_since = time.monotonic()
                if conn not in offer.abort_waiters:
                    offer.abort_waiters.append(conn)
                book.too_many_held(actions)
            if ack:
                book.counts["acks_sent"] += 1
        run(actions)
        if ack:
            conn.send(MsgType.ABORT_ACK, tid=tid)

    def _drop(self, msg: dict[str, object]) -> None:
        """A D shed the handoff of `tid` before pulling it and will never pull it.

        The offer ends now (tombstoned ABORTED: its source pages come back, a later PULL for it is
        refused) only with proof that this hurts no other stream: the frame came over a connection
        of this unit that completed HELLO (peer uid, or the unit-secret handshake, as every frame),
        it names this P instance (a ticket this process issued, not one of an earlier instance at
        the slot), and the offer is still OFFERED, so no D has pulled it and no transfer depends on
        it. An offer already pulled is never ended by a DROP (its puller ends it with ABORT and the
        proofs). Anything else is refused: counted (`drops_refused`) and logged, never answered."""
        book = self._book
        tid, instance = str(msg["tid"]), str(msg["instance"])
        actions: Actions = []
        refused: str | None = None
        late = False
        with book.lock:
            offer = book.offers.get(tid)
            if instance != self._instance_id:
                refused = f"it names P instance {instance}, this is {self._instance_id}"
            elif offer is None:
                late = tid in book.recent  # ended meanwhile (TTL, close): nothing left to drop
                refused = "the offer has ended already" if late else "no such offer was made here"
            elif offer.state is not OfferState.OFFERED:
                refused = f"the offer is {offer.state.name}: pulled, so only its puller's ABORT ends it"
            else:
                book.tombstone(offer, OfferState.ABORTED, actions)
                book.counts["offers_dropped"] += 1
            if refused is not None:
                book.counts["drops_refused"] += 1
        run(actions)
        if refused is not None:
            log.log(logging.INFO if late else logging.WARNING, "refused DROP of offer %s: %s", tid, refused)


def _peer_name(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername())
    except OSError:
        return "a closed connection"
