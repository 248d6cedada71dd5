"""P's side: hold offers, serve PULLs with one contiguous copy, and ACK aborts only with proof.

Journey of an offer: `offer()` -> OFFERED (P's pages held) -> PULL accepted -> QUEUED -> a copy worker
takes it -> COPYING: gather into staging (then the source is released), checksum, `copy_hook`, one copy
into D's region -> COPIED, reply DONE. A PULL_ROWS (direct mode: D's arena is its KV pool) instead has
the worker write P's rows straight into the D slots it names (`path.write_rows`: the GPU paths hash
them in the same kernel, the others after the write), releasing the source after the write; a
`copy_hook` (fault injection) acts around that same write (`Copier`), so drills run the production call.
Off the happy path an offer is tombstoned (ABORTED/EXPIRED) before any write, or the copy fails after
its copy call returned (FAILED). Terminal offers leave the table; a later PULL for their id is refused
(tids are random and never reused, so "not in the table" is proof that no copy for it will start),
and a later ABORT is ACKed at once.

A DROP (D shed the handoff and will never pull it) ends an offer that nobody has pulled at once, so
its source pages come back before the TTL; it ends nothing else (`_drop` says what it checks).

ABORT during COPYING cannot be proven yet: P holds the ACK and sends it (instead of DONE) when the copy
returns. Holding `max_held_acks` ACKs at once, or one for longer than `max_hold_s`, calls `on_fatal`: the
engine exits and its restart (new instance id, lock released) becomes the proof D needs.

Threads: one accept/housekeeping thread, one reader per D connection (`sender_loop.py`), `copy_workers`
copy workers (`copier.py`). Engine callbacks (`gather`, `on_source_released`, `on_fatal`, `on_event`)
run on those threads, never under the sender's lock. The parts: `offers` (every state change, under
one lock), `sender_loop` (the threads that serve D), `copier` (the copies), `pull_checks` (what P
checks of D's frames).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import socket
import time
from collections.abc import Callable

import torch

from ._actions import Actions, run
from ._offer import GatherFn, Offer, Rows
from .auth import sign_ticket
from .control import UNIT_PARAMETER, InstanceLock, endpoint_paths, listen_tcp, listen_unix, tcp_endpoint
from .copier import Copier
from .errors import SenderClosed, TransferError
from .layout import WireLayout
from .offers import OfferBook
from .paths.base import TransferPath
from .sender_loop import SenderLoop
from .state import OfferState, SenderStats, Ticket, TransferEvent

log = logging.getLogger(__name__)


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
        """`copy_hook(tid, staging)`: the fault-injection seam (`Copier`).

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
        self._n_workers = copy_workers
        self._lock_wait_s = lock_wait_s
        self._instance_lock = InstanceLock(lock_path)
        self._server: socket.socket | None = None
        self._book = OfferBook(path.name, on_source_released, on_fatal, on_event, max_held_acks, max_hold_s)
        self._copier = Copier(self._book, path, layout, copy_hook)
        self._loop = SenderLoop(
            self._book,
            self._copier,
            layout=layout,
            path=path,
            instance_id=self.instance_id,
            control=control,
            secret=secret,
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
                    f"(two units on one host need different `{UNIT_PARAMETER}` parameters on their "
                    "prefill and decode models, or different XDG_RUNTIME_DIRs), or the previous P of "
                    f"this one did not exit within {self._lock_wait_s:g} s"
                )
            time.sleep(0.02)
        self.path.share_instance_lock(self._instance_lock.fd)
        if self.control == "tcp":
            server = listen_tcp(self._bind_host)
            self.endpoint = tcp_endpoint(self._advertise_host, server.getsockname()[1])
            self.lock_path = ""  # no lock D could probe across hosts (and none it needs: D writes)
            log.info("P control plane on %s (tcp, unit-secret handshake)", self.endpoint)
        else:
            server = listen_unix(self._sock_path)
        server.settimeout(0.05)
        self._server = server
        self._loop.start(server)
        self._copier.start(self._n_workers)

    def close(self, timeout_s: float = 10.0) -> None:
        """Called once at engine shutdown. Releases every unpulled offer's source, waits for copies in
        progress, then closes connections and gives up the instance lock. If a copy does not finish in
        `timeout_s` it raises `TransferError` and keeps the lock (held until process exit), so no D
        mistakes this instance for gone while its write may still land."""
        book = self._book
        actions: Actions = []
        with book.lock:
            book.closing = True
            for offer in list(book.offers.values()):
                if offer.state in (OfferState.OFFERED, OfferState.QUEUED):
                    book.tombstone(offer, OfferState.ABORTED, actions)
        run(actions)
        self._loop.stop_accepting()
        if not self._copier.stop(timeout_s):
            raise TransferError("a copy is still running; the instance lock stays held until exit")
        self._loop.close()
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
        with self._book.lock:
            if self._book.closing or self._book.fatal or self._server is None:
                raise SenderClosed("sender is not serving (not started, closing or fatal)")
            self._book.offers[tid] = Offer(tid, n_tokens, nbytes, gather, time.monotonic() + ttl_s, rows)
            self._book.counts["offers_total"] += 1
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
        with self._book.lock:
            return self._book.stats(self._loop.connections)
