"""P's side: hold offers, serve PULLs with one contiguous copy, and ACK aborts only with proof.

Journey of an offer: `offer()` -> OFFERED (P's pages held) -> PULL accepted -> QUEUED -> a copy worker
takes it -> COPYING: gather into staging (then the source is released), checksum, `copy_hook`, one copy
into D's region -> COPIED, reply DONE. A PULL_ROWS (direct mode: D's arena is its KV pool) instead has
the worker write P's rows straight into the D slots it names (`path.write_rows`: the GPU paths hash
them in the same kernel, the others after the write), releasing the source after the write; with a
`copy_hook` (fault injection) the rows go through a staging buffer so the hook can alter what lands
after the checksum.
Off the happy path an offer is tombstoned (ABORTED/EXPIRED) before any write, or the copy fails after
its copy call returned (FAILED). Terminal offers leave the table; a later PULL for their id is refused
(tids are random and never reused, so "not in the table" is proof that no copy for it will start),
and a later ABORT is ACKed at once.

A DROP (D shed the handoff and will never pull it) ends an offer that nobody has pulled at once, so
its source pages come back before the TTL; it ends nothing else (`_drop` says what it checks).

ABORT during COPYING cannot be proven yet: P holds the ACK and sends it (instead of DONE) when the copy
returns. Holding `max_held_acks` ACKs at once, or one for longer than `max_hold_s`, calls `on_fatal`: the
engine exits and its restart (new instance id, lock released) becomes the proof D needs.

Threads: one accept/housekeeping thread, one reader per D connection, `copy_workers` copy workers.
Engine callbacks (`gather`, `on_source_released`, `on_fatal`, `on_event`) run on those threads, never
under the sender's lock.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from ._conn import Connection, accepted
from ._offer import GatherFn, Offer, Peer, Rows
from .auth import AuthFailed, accept_handshake, sign_ticket
from .checksum import format_checksum, kv_checksum, kv_checksum_rows
from .control import (
    CONTROL_MAGIC,
    CONTROL_ROLES,
    InstanceLock,
    endpoint_paths,
    listen_tcp,
    listen_unix,
    same_user,
    tcp_endpoint,
)
from .errors import ProtocolError, SenderClosed, TransferError
from .frames import PROTOCOL_VERSION, FailReason, MsgType, expand_runs
from .layout import WireLayout
from .paths import TransferPath, pool_slots
from .state import OfferState, SenderStats, Ticket, TransferEvent

log = logging.getLogger(__name__)
_RECENT_MAX = 4096
_MAX_HANDSHAKES = 16  # tcp control: connections still proving themselves; more are closed at once


class TransferSender:
    """Serves one P process's offers to any number of D receivers of the same unit."""

    def __init__(
        self,
        layout: WireLayout,
        unit: str,
        path: TransferPath,
        on_source_released: Callable[[str], None],
        on_fatal: Callable[[str], None],
        *,
        slot: str = "p0",
        max_held_acks: int = 3,
        max_hold_s: float | None = 30.0,
        copy_workers: int = 3,
        lock_wait_s: float = 5.0,
        on_event: Callable[[TransferEvent], None] | None = None,
        copy_hook: Callable[[str, torch.Tensor], None] | None = None,
        control: str = "unix",
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        secret: bytes | None = None,
    ) -> None:
        """`copy_hook(tid, staging)` is a fault-injection seam: called on the copy worker after gather and
        checksum, right before the copy crosses (it may delay, or alter `staging` to simulate corruption).
        Production code passes None unless fault injection is configured.

        At most `copy_workers` copies run at once, so at most that many ACKs can be held: keep it
        >= `max_held_acks` or only the `max_hold_s` watchdog can declare P fatal.

        `control="tcp"` serves the control plane on a TCP port of `bind_host` (tickets name
        `tcp://<advertise_host or bind_host>:<port>`) for D receivers on other hosts, each proving it
        holds `secret` (the unit secret, `transfer/auth.py`). Across hosts there is no instance lock
        for D to probe, so only a path where D writes every byte itself (`receiver_writes`, the tcp
        path) may use it; anything else raises `TransferError` here."""
        if control not in ("unix", "tcp"):
            raise TransferError(f"control must be 'unix' or 'tcp', got {control!r}")
        if control == "tcp" and not path.receiver_writes:
            raise TransferError(
                f"the {path.name} path cannot use a tcp control plane: across hosts D has no process-death "
                "proof, so only a path where D writes every byte itself (tcp) may"
            )
        if control == "tcp" and secret is None:
            raise TransferError("a tcp control plane needs the unit secret (secret=...)")
        self.control = control
        self._handshakes = threading.BoundedSemaphore(_MAX_HANDSHAKES)  # tcp: unauthenticated peers
        self._bind_host = bind_host
        self._advertise_host = advertise_host or bind_host
        self._secret = secret
        self.layout = layout
        self.path = path
        self.instance_id = secrets.token_hex(16)
        sock_path, lock_path = endpoint_paths(unit, slot)
        self._sock_path = sock_path
        self.endpoint = str(sock_path)
        self.lock_path = str(lock_path)
        self._on_source_released = on_source_released
        self._on_fatal = on_fatal
        self._on_event = on_event
        self._copy_hook = copy_hook
        self._max_held = max_held_acks
        self._max_hold_s = max_hold_s
        self._n_workers = copy_workers
        self._lock_wait_s = lock_wait_s
        self._instance_lock = InstanceLock(lock_path)
        self._lock = threading.Lock()
        self._offers: dict[str, Offer] = {}
        self._recent: OrderedDict[str, OfferState] = OrderedDict()
        self._peers: set[Peer] = set()
        self._jobs: queue.Queue[Offer | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._workers: list[threading.Thread] = []
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self._closing = False
        self._fatal = False
        self._counts = dict.fromkeys(
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

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Called once by the engine before its first `offer`. Takes the slot's instance lock (waiting
        up to `lock_wait_s` for a previous instance to die), binds the endpoint and starts the threads.
        Raises `TransferError` if another live instance holds the slot."""
        deadline = time.monotonic() + self._lock_wait_s
        while not self._instance_lock.try_acquire():
            if time.monotonic() > deadline:
                raise TransferError(
                    f"another P instance holds {self.lock_path}: another server serves the same unit "
                    "(two units on one host need different `tandem.transfer.unit` parameters on their "
                    "prefill and decode models, or different XDG_RUNTIME_DIRs), or the previous P of "
                    f"this one did not exit within {self._lock_wait_s:g} s"
                )
            time.sleep(0.02)
        self.path.share_instance_lock(self._instance_lock.fd)
        if self.control == "tcp":
            self._server = listen_tcp(self._bind_host)
            self.endpoint = tcp_endpoint(self._advertise_host, self._server.getsockname()[1])
            self.lock_path = ""  # no lock D could probe across hosts (and none it needs: D writes)
            log.info("P control plane on %s (tcp, unit-secret handshake)", self.endpoint)
        else:
            self._server = listen_unix(self._sock_path)
        self._server.settimeout(0.05)
        self._spawn(self._accept_loop, "tandem-p-accept")
        for i in range(self._n_workers):
            self._workers.append(self._spawn(self._copy_loop, f"tandem-p-copy{i}"))

    def close(self, timeout_s: float = 10.0) -> None:
        """Called once at engine shutdown. Releases every unpulled offer's source, waits for copies in
        progress, then closes connections and gives up the instance lock. If a copy does not finish in
        `timeout_s` it raises `TransferError` and keeps the lock (held until process exit), so no D
        mistakes this instance for gone while its write may still land."""
        actions: list[Callable[[], None]] = []
        with self._lock:
            self._closing = True
            for offer in list(self._offers.values()):
                if offer.state in (OfferState.OFFERED, OfferState.QUEUED):
                    self._tombstone(offer, OfferState.ABORTED, actions)
        _run(actions)
        self._stop.set()
        for _ in self._workers:
            self._jobs.put(None)
        end = time.monotonic() + timeout_s
        for t in self._workers:
            t.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in self._workers):
            raise TransferError("a copy is still running; the instance lock stays held until exit")
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            peer.conn.shutdown()
        for t in self._threads:
            t.join(2.0)
        if self._server is not None:
            self._server.close()
            if self.control == "unix":
                self._sock_path.unlink(missing_ok=True)
        self.path.share_instance_lock(None)
        self._instance_lock.release()

    # ---- engine API ------------------------------------------------------------------------------

    def offer(self, n_tokens: int, gather: GatherFn, ttl_s: float, rows: Rows | None = None) -> Ticket:
        """Called by the engine once per prefilled request, after its KV is in P's pool.

        From now on P's source pages belong to the sender: `gather(out)` may be called (at most once, on
        a copy worker) to write the request's rows into `out` (shape `layout.staging_shape(n_tokens)`,
        written to). `rows = (pool, slots)` (P's pool `layout.staging_shape(S)` and the request's
        `n_tokens` int64 slots on the pool's device) lets a D in direct mode have them written into its
        pool in place (PULL_ROWS); without it such a PULL is refused (NO_DIRECT).
        `on_source_released(tid)` is called exactly once — after the gather (direct: after the write),
        or when the offer is aborted, expires after `ttl_s` unpulled, or the sender closes — and only
        then may the engine free the pages. Returns the ticket to send to D.
        """
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if rows is not None and (rows[1].dim() != 1 or rows[1].numel() != n_tokens):
            raise ValueError(f"rows: slots must be [{n_tokens}], got {tuple(rows[1].shape)}")
        nbytes = self.layout.staging_nbytes(n_tokens)
        tid = secrets.token_hex(16)
        with self._lock:
            if self._closing or self._fatal or self._server is None:
                raise SenderClosed("sender is not serving (not started, closing or fatal)")
            self._offers[tid] = Offer(tid, n_tokens, nbytes, gather, time.monotonic() + ttl_s, rows)
            self._counts["offers_total"] += 1
        ticket = Ticket(
            tid,
            self.endpoint,
            self.lock_path,
            self.instance_id,
            n_tokens,
            nbytes,
            self.layout.fingerprint(),
            self.path.name,
        )
        if self._secret is not None:  # tcp control: D follows only tickets this unit's P signed
            ticket = dataclasses.replace(ticket, mac=sign_ticket(self._secret, ticket.signing_bytes()))
        return ticket

    def stats(self) -> SenderStats:
        """Snapshot for metrics; any thread, any time."""
        with self._lock:
            return SenderStats(
                offers_open=len(self._offers),
                held_acks=self._held_count(),
                connections=len(self._peers),
                **self._counts,
            )

    # ---- threads ---------------------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]  # connections come and go
        return t

    def _accept_loop(self) -> None:
        assert self._server is not None
        for sock in accepted(self._server, self._stop, self._housekeeping):
            if self.control == "unix" and not same_user(sock):
                sock.close()
                continue
            if self.control == "tcp" and not self._handshakes.acquire(blocking=False):
                log.warning("refused a control connection from %s: too many handshakes", _peer_name(sock))
                sock.close()
                continue
            try:
                self._spawn(self._serve_connection, "tandem-p-conn", sock)
            except RuntimeError as exc:  # cannot start a thread: refuse this one, keep accepting
                log.error("refused a control connection: %s", exc)
                if self.control == "tcp":
                    self._handshakes.release()
                sock.close()

    def _serve_connection(self, sock: socket.socket) -> None:
        """One D connection: on TCP first the unit-secret handshake, then the protocol (`_read_loop`)."""
        if self.control == "tcp":
            try:
                accept_handshake(sock, self._secret or b"", CONTROL_MAGIC, CONTROL_ROLES)
            except (AuthFailed, OSError, EOFError) as exc:
                with self._lock:
                    self._counts["auth_failures"] += 1
                log.warning("refused a control connection from %s: %s", _peer_name(sock), exc)
                sock.close()
                return
            finally:
                self._handshakes.release()
        peer = Peer(Connection(sock))
        with self._lock:
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
                    peer.conn.send(MsgType.PONG, nonce=msg["nonce"], instance=self.instance_id)
                else:
                    raise ProtocolError(f"unexpected {kind.name} from D")
        except (EOFError, OSError, ProtocolError):
            pass
        finally:
            with self._lock:
                self._peers.discard(peer)
            peer.conn.finish()  # the PeerArena mapping stays alive while a copy still references it

    def _hello(self, peer: Peer, msg: dict[str, object], fds: list[int]) -> bool:
        reason: FailReason | None = None
        detail = ""
        if msg["v"] != PROTOCOL_VERSION:
            reason = FailReason.BAD_VERSION
        elif msg["path"] != self.path.name:
            reason = FailReason.PATH_MISMATCH
        elif msg["layout_fp"] != self.layout.fingerprint() or msg["layout"] != self.layout.to_dict():
            reason = FailReason.LAYOUT_MISMATCH
            detail = f"LAYOUT_MISMATCH in HELLO: D's KV is {msg['layout']}, P's {self.layout.describe()}"
        if reason is None:
            try:
                peer.arena = self.path.open_peer_arena(msg["arena"], fds)  # type: ignore[arg-type]
            except TransferError as exc:
                peer.conn.send(MsgType.FAILED, tid=None, reason=int(FailReason.BAD_REGION), detail=str(exc))
                return False
            return peer.conn.send(MsgType.HELLO_ACK, v=PROTOCOL_VERSION, instance=self.instance_id)
        for fd in fds:
            os.close(fd)
        detail = detail or f"{reason.name} in HELLO"
        peer.conn.send(MsgType.FAILED, tid=None, reason=int(reason), detail=detail)
        return False

    def _pull(self, peer: Peer, msg: dict[str, object]) -> None:
        """A PULL (copy into D's region at `offset`) or a PULL_ROWS (write D's pool at the `dst` runs)."""
        tid = str(msg["tid"])
        direct = "dst" in msg
        offset = 0 if direct else int(msg["offset"])  # type: ignore[call-overload]
        nbytes = int(msg["nbytes"])  # type: ignore[call-overload]
        remaining_s = float(msg["remaining_ms"]) / 1000.0  # type: ignore[arg-type]
        actions: list[Callable[[], None]] = []
        reason: FailReason | None = None
        dst: list[int] | None = None
        bad: str | None = None
        if direct:
            dst = msg["dst"]  # type: ignore[assignment]
            bad = self._bad_dst(peer, dst, nbytes)
            if bad is not None:
                log.warning("refused PULL_ROWS %s: %s", tid, bad)
        with self._lock:
            offer = self._offers.get(tid)
            if self._closing or self._fatal:
                reason = FailReason.CLOSING
            elif offer is None:
                past = self._recent.get(tid)
                refusals = {OfferState.EXPIRED: FailReason.EXPIRED, OfferState.ABORTED: FailReason.ABORTED}
                reason = refusals.get(past, FailReason.UNKNOWN) if past is not None else FailReason.UNKNOWN
            elif offer.state is not OfferState.OFFERED:
                reason = FailReason.UNKNOWN  # already pulled: only one PULL per offer
            elif direct and (offer.rows is None or not self.path.direct_write):
                reason = FailReason.NO_DIRECT
                self._tombstone(offer, OfferState.ABORTED, actions)  # D never pulls a tid twice
            elif (
                peer.arena is None
                or nbytes != offer.nbytes
                or not 0 <= offset <= peer.arena.nbytes - nbytes
                or (direct and bad is not None)
            ):
                reason = FailReason.BAD_REGION
                self._tombstone(offer, OfferState.ABORTED, actions)  # its pages need not wait for the TTL
            elif remaining_s <= 0:
                self._tombstone(offer, OfferState.EXPIRED, actions)  # refused before start: proof
                reason = FailReason.EXPIRED
            else:
                offer.state = OfferState.QUEUED
                offer.pull_peer, offer.pull_offset, offer.pull_dst = peer, offset, dst
                offer.pull_deadline = time.monotonic() + remaining_s
                self._jobs.put(offer)
            if reason is not None:
                self._counts["pulls_refused"] += 1
        _run(actions)
        if reason is not None:
            detail = f"{reason.name}: {bad}" if reason is FailReason.BAD_REGION and bad else reason.name
            peer.conn.send(MsgType.FAILED, tid=tid, reason=int(reason), detail=detail)

    def _bad_dst(self, peer: Peer, dst: object, nbytes: int) -> str | None:
        """Why a PULL_ROWS's destination runs cannot be written (None: they can): not [start, count]
        int pairs, a run outside D's pool, or a total that is not `nbytes` of tokens."""
        if peer.arena is None:
            return "no arena"
        try:
            slots = pool_slots(self.layout, peer.arena.nbytes, "D's")
        except TransferError as exc:
            return str(exc)
        if not isinstance(dst, list) or len(dst) % 2 or not all(type(x) is int for x in dst):
            return "dst is not a flat list of [start, count] int pairs"
        total = 0
        for start, count in zip(dst[::2], dst[1::2], strict=True):
            if count <= 0 or start < 0 or start + count > slots:
                return f"run [{start}, {count}] outside D's {slots} slots"
            total += count
        if total * self.layout.token_bytes != nbytes:
            return f"{total} destination slots for {nbytes} bytes"
        return None

    def _abort(self, conn: Connection, tid: str) -> None:
        actions: list[Callable[[], None]] = []
        ack = True
        with self._lock:
            offer = self._offers.get(tid)
            if offer is not None and offer.state in (OfferState.OFFERED, OfferState.QUEUED):
                self._tombstone(offer, OfferState.ABORTED, actions)  # a queued job will skip it
            elif offer is not None and offer.state is OfferState.COPYING:
                ack = False  # no proof yet: the ACK goes out when the copy returns
                if not offer.abort_waiters:
                    offer.held_since = time.monotonic()
                if conn not in offer.abort_waiters:
                    offer.abort_waiters.append(conn)
                if self._held_count() >= self._max_held:
                    self._go_fatal(f"{self._held_count()} ABORT_ACKs held (copies not finishing)", actions)
            if ack:
                self._counts["acks_sent"] += 1
        _run(actions)
        if ack:
            conn.send(MsgType.ABORT_ACK, tid=tid)

    def _drop(self, msg: dict[str, object]) -> None:
        """Reader thread: a D shed the handoff of `tid` before pulling it and will never pull it.

        The offer ends now (tombstoned ABORTED: its source pages come back, a later PULL for it is
        refused) only with proof that this hurts no other stream: the frame came over a connection
        of this unit that completed HELLO (peer uid, or the unit-secret handshake, as every frame),
        it names this P instance (a ticket this process issued, not one of an earlier instance at
        the slot), and the offer is still OFFERED, so no D has pulled it and no transfer depends on
        it. An offer already pulled is never ended by a DROP (its puller ends it with ABORT and the
        proofs). Anything else is refused: counted (`drops_refused`) and logged, never answered."""
        tid, instance = str(msg["tid"]), str(msg["instance"])
        actions: list[Callable[[], None]] = []
        refused: str | None = None
        late = False
        with self._lock:
            offer = self._offers.get(tid)
            if instance != self.instance_id:
                refused = f"it names P instance {instance}, this is {self.instance_id}"
            elif offer is None:
                late = tid in self._recent  # ended meanwhile (TTL, close): nothing left to drop
                refused = "the offer has ended already" if late else "no such offer was made here"
            elif offer.state is not OfferState.OFFERED:
                refused = f"the offer is {offer.state.name}: pulled, so only its puller's ABORT ends it"
            else:
                self._tombstone(offer, OfferState.ABORTED, actions)
                self._counts["offers_dropped"] += 1
            if refused is not None:
                self._counts["drops_refused"] += 1
        _run(actions)
        if refused is not None:
            log.log(logging.INFO if late else logging.WARNING, "refused DROP of offer %s: %s", tid, refused)

    def _copy_loop(self) -> None:
        while True:
            offer = self._jobs.get()
            if offer is None:
                return
            self._copy_one(offer)

    def _copy_one(self, offer: Offer) -> None:
        actions: list[Callable[[], None]] = []
        refuse: FailReason | None = None
        peer = offer.pull_peer
        assert peer is not None
        with self._lock:
            if offer.state is not OfferState.QUEUED:  # aborted while queued
                refuse = FailReason.ABORTED
            elif self._closing or self._fatal:
                self._tombstone(offer, OfferState.ABORTED, actions)
                refuse = FailReason.CLOSING
            elif time.monotonic() > offer.pull_deadline:
                self._tombstone(offer, OfferState.EXPIRED, actions)
                refuse = FailReason.EXPIRED
            else:
                offer.state = OfferState.COPYING
                offer.copy_start_ns = time.time_ns()
        _run(actions)
        if refuse is not None:
            peer.conn.send(MsgType.FAILED, tid=offer.tid, reason=int(refuse), detail=refuse.name)
            return
        error: str | None = None
        checksum = 0
        try:
            if offer.pull_dst is not None:
                checksum = self._write_rows(offer, offer.pull_dst)
            else:
                staging = self.path.alloc_staging(self.layout, offer.n_tokens)
                try:
                    offer.gather(staging)
                finally:
                    self._release_source(offer)
                checksum = kv_checksum(staging)
                if self._copy_hook is not None:
                    self._copy_hook(offer.tid, staging)
                assert peer.arena is not None
                self.path.copy_to_peer(staging, peer.arena, offer.pull_offset, offer.tid)
        except Exception as exc:  # the engine's gather or the path failed; the copy call has returned
            error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            offer.copy_end_ns = time.time_ns()
            final = OfferState.COPIED if error is None else OfferState.FAILED
            self._finish(offer, final)
            waiters, offer.abort_waiters = offer.abort_waiters, []
            self._counts["copies_ok" if error is None else "copies_failed"] += 1
            self._counts["bytes_moved"] += offer.nbytes if error is None else 0
            self._counts["acks_sent"] += len(waiters)
            event = self._event(offer, error)
        if waiters:  # D gave up: the ACK (now provable) is the only answer it needs
            for conn in waiters:
                conn.send(MsgType.ABORT_ACK, tid=offer.tid)
        elif error is None:
            peer.conn.send(
                MsgType.DONE,
                tid=offer.tid,
                nbytes=offer.nbytes,
                checksum=format_checksum(checksum),
                copy_start_ns=offer.copy_start_ns,
                copy_end_ns=offer.copy_end_ns,
            )
        else:
            peer.conn.send(MsgType.FAILED, tid=offer.tid, reason=int(FailReason.COPY_ERROR), detail=error)
        if self._on_event is not None:
            self._on_event(event)

    def _write_rows(self, offer: Offer, runs: list[int]) -> int:
        """Copy worker, direct mode: write P's rows into D's pool at `runs` and checksum them (in the
        write's own kernel on the GPU paths), release the source once the write returned (whatever
        happened). Returns the checksum of what P wrote."""
        try:
            assert (
                offer.rows is not None and offer.pull_peer is not None and offer.pull_peer.arena is not None
            )
            src, src_slots = offer.rows
            dst = torch.from_numpy(expand_runs(runs)).to(src.device)
            arena = offer.pull_peer.arena
            if self._copy_hook is None:  # GPU paths hash the rows as their kernel writes them
                written = self.path.write_rows(self.layout, src, src_slots, arena, dst)
                return kv_checksum_rows(src, src_slots) if written is None else written
            # fault injection: the hook may alter what lands after the checksum, never P's pool
            staging = self.path.alloc_staging(self.layout, offer.n_tokens)
            offer.gather(staging)
            checksum = kv_checksum(staging)
            self._copy_hook(offer.tid, staging)
            self.path.write_rows(
                self.layout, staging, torch.arange(offer.n_tokens, device=staging.device), arena, dst
            )
            return checksum
        finally:
            self._release_source(offer)

    # ---- helpers (called with self._lock held unless noted) ---------------------------------------

    def _housekeeping(self) -> None:
        """Accept thread, every ~50 ms: expire unpulled offers, watch held ACKs."""
        actions: list[Callable[[], None]] = []
        now = time.monotonic()
        with self._lock:
            for offer in list(self._offers.values()):
                if offer.state is OfferState.OFFERED and now > offer.expires:
                    self._tombstone(offer, OfferState.EXPIRED, actions)
                elif (
                    offer.abort_waiters
                    and self._max_hold_s is not None
                    and now - offer.held_since > self._max_hold_s
                ):
                    self._go_fatal(f"ABORT_ACK for {offer.tid} held over {self._max_hold_s}s", actions)
        _run(actions)

    def _held_count(self) -> int:
        return sum(1 for o in self._offers.values() if o.abort_waiters)

    def _go_fatal(self, reason: str, actions: list[Callable[[], None]]) -> None:
        if not self._fatal:
            self._fatal = True
            actions.append(lambda: self._on_fatal(reason))

    def _tombstone(self, offer: Offer, state: OfferState, actions: list[Callable[[], None]]) -> None:
        """End an offer before any write: from now on no copy for it can start."""
        self._counts["offers_expired" if state is OfferState.EXPIRED else "offers_aborted"] += 1
        self._finish(offer, state)
        if not offer.source_released:
            offer.source_released = True
            actions.append(lambda: self._on_source_released(offer.tid))
        if self._on_event is not None:
            event, cb = self._event(offer, state.name), self._on_event
            actions.append(lambda: cb(event))

    def _finish(self, offer: Offer, state: OfferState) -> None:
        offer.state = state
        self._offers.pop(offer.tid, None)
        self._recent[offer.tid] = state
        while len(self._recent) > _RECENT_MAX:
            self._recent.popitem(last=False)

    def _release_source(self, offer: Offer) -> None:
        """Copy worker, without the lock held: exactly-once source release after the gather."""
        with self._lock:
            if offer.source_released:
                return
            offer.source_released = True
        self._on_source_released(offer.tid)

    def _event(self, offer: Offer, error: str | None) -> TransferEvent:
        return TransferEvent(
            offer.tid,
            offer.nbytes,
            offer.state.name,
            error,
            self.path.name,
            copy_start_ns=offer.copy_start_ns,
            copy_end_ns=offer.copy_end_ns,
        )


def _run(actions: list[Callable[[], None]]) -> None:
    for action in actions:
        action()


def _peer_name(sock: socket.socket) -> str:
    try:
        return str(sock.getpeername())
    except OSError:
        return "a closed connection"
