"""D's connection loop: the maintenance thread and one reader thread per P control connection.

Who calls: `TransferReceiver` starts it, `kick`s it when work is queued and `close`s it once. The
maintenance thread fails transfers past their deadline, (re)connects endpoints, re-sends ABORT for
quarantined regions every `abort_retry_s`, sends queued DROPs and pings every known endpoint every
`probe_interval_s`, so a restarted P is found even with no traffic. A reader turns P's frames into
`RegionBook` transitions; a lost connection fails the transfers it carried (their regions stay
quarantined until a proof). Memory: none of its own; it changes the book's records under the book's
lock and hashes a DONE's region through the `Verifier` outside it.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time

from ._actions import Actions, run
from ._conn import Connection
from ._endpoint import Endpoint, failure_for
from .auth import AuthFailed, connect_handshake
from .control import (
    CONTROL_MAGIC,
    CONTROL_ROLES,
    connect_tcp,
    connect_unix,
    instance_gone,
    parse_tcp_endpoint,
    same_user,
)
from .errors import PeerLost, ProtocolError, TransferTimeout
from .frames import PROTOCOL_VERSION, MsgType
from .handle import TransferHandle
from .layout import WireLayout
from .paths.base import LocalArena, TransferPath
from .regions import RegionBook
from .state import RegionState, ReleaseReason, TransferState
from .verifier import Verifier


class ReceiverLoop:
    """The threads of one receiver; see the module docstring for what each does."""

    def __init__(
        self,
        book: RegionBook,
        verifier: Verifier,
        kick: threading.Event,
        *,
        layout: WireLayout,
        path: TransferPath,
        arena: LocalArena,
        instance_id: str,
        secret: bytes | None,
        abort_retry_s: float,
        probe_interval_s: float,
        connect_timeout_s: float,
        lock_proof: bool,
    ) -> None:
        self._book = book
        self._verifier = verifier
        self._kick = kick
        self._layout = layout
        self._path = path
        self._arena = arena
        self._instance_id = instance_id
        self._secret = secret
        self._abort_retry_s = abort_retry_s
        self._probe_interval_s = probe_interval_s
        self._connect_timeout_s = connect_timeout_s
        self._lock_proof = lock_proof
        self._stop = threading.Event()
        self._readers: list[threading.Thread] = []
        self._tick = min(0.05, abort_retry_s / 2, probe_interval_s / 2)
        self._maint = threading.Thread(target=self._maintenance_loop, name="tandem-d-maint", daemon=True)
        self._maint.start()

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def close(self) -> None:
        """Stops the maintenance thread, sends the DROPs still queued, shuts every connection down
        and waits for the readers."""
        self._stop.set()
        self._kick.set()
        self._maint.join(5.0)
        actions: Actions = []
        with self._book.lock:
            for ep in self._book.endpoints.values():  # the last sheds (close fails the queue) still count
                self.send_drops(ep, actions)
        run(actions)
        with self._book.lock:
            conns = [ep.conn for ep in self._book.endpoints.values() if ep.conn is not None]
        for conn in conns:
            conn.shutdown()
        for t in self._readers:
            t.join(2.0)

    # ---- messages from P (reader threads) ----------------------------------------------------------

    def _read_loop(self, ep: Endpoint, conn: Connection, gen: int) -> None:
        book = self._book
        try:
            while True:
                kind, msg, _ = conn.reader.read()
                self._on_message(ep, gen, kind, msg)
        except (EOFError, OSError, ProtocolError):
            pass
        finally:
            conn.finish()
            actions: Actions = []
            with book.lock:
                if ep.gen == gen:
                    ep.conn, ep.instance = None, None
                    for h in list(ep.handles):
                        if h.sent_gen == gen:
                            book.fail(h, PeerLost(f"control connection to {ep.path} lost"), actions)
                    for h in ep.queued:
                        book.fail(h, PeerLost(f"control connection to {ep.path} lost"), actions)
                    ep.queued.clear()
                    self._kick.set()
            run(actions)

    def _on_message(self, ep: Endpoint, gen: int, kind: MsgType, msg: dict[str, object]) -> None:
        book = self._book
        actions: Actions = []
        verify: TransferHandle | None = None
        with book.lock:
            if ep.gen != gen:
                return
            ep.last_contact = time.monotonic()
            h = book.handles.get(str(msg.get("tid")))
            if h is not None and h.ticket.endpoint != ep.path:
                h = None
            if kind is MsgType.HELLO_ACK:
                ep.instance = str(msg["instance"])
                book.lost_instance(ep, ReleaseReason.INSTANCE_CHANGED, actions, keep=ep.instance)
                queued, ep.queued = ep.queued, []
                book.dispatch(ep, queued, actions)
                self._due_aborts(ep, time.monotonic(), actions, force=True)
                self.send_drops(ep, actions)
            elif ep.instance is None:
                if kind is not MsgType.FAILED:
                    raise ProtocolError(f"{kind.name} before HELLO_ACK")
                queued, ep.queued = ep.queued, []
                ep.drops.clear()  # P refused our HELLO: it will not take a DROP either (TTL backstop)
                for q in queued:
                    book.fail(q, failure_for(int(msg["reason"]), str(msg["detail"])), actions)  # type: ignore[call-overload]
            elif kind is MsgType.PONG:
                if msg["instance"] != ep.instance:
                    raise ProtocolError("PONG instance differs from HELLO_ACK on one connection")
            elif h is None or h.sent_gen < 0:
                pass  # late or duplicate message for a transfer D already forgot: harmless
            elif kind is MsgType.ABORT_ACK:
                if h.sent_instance == ep.instance:
                    book.release(h, ReleaseReason.ABORT_ACK, actions)
            elif h.sent_gen != gen:
                pass  # DONE/FAILED answer the PULL on its own connection only
            elif kind is MsgType.DONE:
                if h.state is TransferState.REQUESTED:
                    h.state = TransferState.DONE
                    h.stamps.copy_start_ns = int(msg["copy_start_ns"])  # type: ignore[call-overload]
                    h.stamps.copy_end_ns = int(msg["copy_end_ns"])  # type: ignore[call-overload]
                    h.stamps.done_received_ns = time.time_ns()
                    verify = h
                else:  # a DONE after D gave up still proves the copy is over
                    book.release(h, ReleaseReason.DONE, actions)
            elif kind is MsgType.FAILED:
                err = failure_for(int(msg["reason"]), str(msg["detail"]))  # type: ignore[call-overload]
                if h.state is TransferState.REQUESTED:
                    book.fail(h, err, actions, proof=ReleaseReason.REFUSED)
                else:
                    book.release(h, ReleaseReason.REFUSED, actions)
            else:
                raise ProtocolError(f"unexpected {kind.name} from P")
        run(actions)
        if verify is not None:
            ours = self._verifier.checksum(verify)  # no lock: the region is the transfer's (DONE)
            after: Actions = []
            with book.lock:
                book.verified(verify, ours, str(msg["checksum"]), after)
            run(after)

    # ---- maintenance thread ----------------------------------------------------------------------

    def _due_aborts(self, ep: Endpoint, now: float, actions: Actions, force: bool = False) -> None:
        conn = ep.conn
        if conn is None or ep.instance is None:
            return
        for h in ep.handles:
            if (
                h.region_state is RegionState.QUARANTINED
                and h.sent_instance == ep.instance
                and (force or now - h.last_abort >= self._abort_retry_s)
            ):
                h.last_abort = now
                self._book.counts["aborts_sent"] += 1
                actions.append(conn.later(MsgType.ABORT, tid=h.transfer_id))

    def send_drops(self, ep: Endpoint, actions: Actions) -> None:
        """Book lock held. Queued DROPs go out on a ready connection; those naming another P instance
        than the one that answers are moot (the offer died with its instance) and are forgotten."""
        if not ep.drops or ep.conn is None or ep.instance is None:
            return
        drops, ep.drops = ep.drops, []
        for tid, instance in drops:
            if instance == ep.instance:
                self._book.counts["drops_sent"] += 1
                actions.append(ep.conn.later(MsgType.DROP, tid=tid, instance=instance))

    def _maintenance_loop(self) -> None:
        book = self._book
        while not self._stop.is_set():
            self._kick.wait(self._tick)
            self._kick.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            actions: Actions = []
            to_connect: list[Endpoint] = []
            with book.lock:
                for h in list(book.handles.values()):
                    if h.state is TransferState.REQUESTED and now > h.deadline:
                        book.fail(
                            h, TransferTimeout(f"no DONE within the deadline for {h.transfer_id}"), actions
                        )
                for key, ep in list(book.endpoints.items()):
                    if ep.conn is None:
                        retry = min(self._abort_retry_s, self._probe_interval_s)
                        if ep.queued or ep.drops or now - ep.last_connect >= retry:
                            idle = now - ep.last_contact > 10 * self._probe_interval_s
                            if not (ep.queued or ep.handles or ep.drops) and idle:
                                del book.endpoints[key]  # unreachable and nothing depends on it
                                continue
                            ep.last_connect = now
                            to_connect.append(ep)
                    elif ep.instance is not None:
                        self._due_aborts(ep, now, actions)
                        self.send_drops(ep, actions)
                        if now - ep.last_ping >= self._probe_interval_s:
                            ep.last_ping = now
                            actions.append(ep.conn.later(MsgType.PING, nonce=secrets.randbits(31)))
            run(actions)
            for ep in to_connect:
                self._connect(ep)

    def _open(self, ep: Endpoint) -> socket.socket:
        """A connected, authenticated control socket to `ep` (unix: peer uid; tcp: unit secret)."""
        tcp = parse_tcp_endpoint(ep.path)
        if tcp is None:
            sock = connect_unix(ep.path, self._connect_timeout_s)
            if not same_user(sock):
                sock.close()
                raise OSError(f"{ep.path} is served by another user")
            return sock
        sock = connect_tcp(*tcp, self._connect_timeout_s)
        try:
            connect_handshake(
                sock, self._secret or b"", CONTROL_MAGIC, CONTROL_ROLES, what="P control endpoint"
            )
        except BaseException:
            sock.close()
            raise
        return sock

    def _connect(self, ep: Endpoint) -> None:
        book = self._book
        actions: Actions = []
        try:
            sock = self._open(ep)
        except (OSError, EOFError, AuthFailed) as exc:
            with book.lock:
                for h in ep.queued:
                    book.fail(h, PeerLost(f"cannot reach P at {ep.path}: {exc}"), actions)
                ep.queued.clear()
                ep.drops.clear()  # P unreachable: its offers expire at their TTL (or died with it)
                if self._lock_proof and ep.handles and ep.lock_path and instance_gone(ep.lock_path):
                    book.lost_instance(ep, ReleaseReason.INSTANCE_GONE, actions)
            run(actions)
            return
        conn = Connection(sock)
        with book.lock:
            ep.gen += 1
            ep.conn, ep.instance, ep.last_contact = conn, None, time.monotonic()
            gen = ep.gen
        exp = self._arena.export()
        conn.send(
            MsgType.HELLO,
            fds=exp.fds,
            v=PROTOCOL_VERSION,
            layout=self._layout.to_dict(),
            layout_fp=self._layout.fingerprint(),
            path=self._path.name,
            arena=exp.meta,
            d_instance=self._instance_id,
        )
        t = threading.Thread(target=self._read_loop, args=(ep, conn, gen), name="tandem-d-conn", daemon=True)
        self._readers = [r for r in self._readers if r.is_alive()] + [t]
        t.start()
