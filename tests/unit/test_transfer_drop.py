"""DROP: D tells P it will never pull a ticket, and P frees the offer's pages at once, only with proof.

Sender and receivers in one process over the host path. P ends an offer on a DROP only if the frame
names its own instance and nobody has pulled the offer; every other DROP is refused, counted and
logged, and D refuses to send one for a ticket it cannot attribute to its unit or has requested.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Iterator

import pytest

from tandem.transfer import (
    HostShmPath,
    TransferReceiver,
    TransferSender,
    TransferState,
    UnknownTransfer,
    WireLayout,
)
from tests.support import transfer_fakes
from tests.support.transfer_fakes import HookControl, fake_kv

LAYOUT = WireLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_name="bfloat16")
ARENA = 1 << 22
DROP_BOUND_S = 1.0  # DROP to P's release of the source; the offer's TTL here is 30 s


@dataclasses.dataclass
class Unit:
    s: TransferSender
    hook: HookControl
    released: list[str]
    receivers: list[TransferReceiver]

    def receiver(self) -> TransferReceiver:
        r = TransferReceiver(LAYOUT, "u", ARENA, HostShmPath(), abort_retry_s=0.05, probe_interval_s=0.1)
        self.receivers.append(r)
        return r

    def offer(self, n: int = 8, seed: int = 0):
        data = fake_kv(LAYOUT, n, seed)
        return self.s.offer(n, lambda out: out.copy_(data), 30.0)


@pytest.fixture
def unit(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Unit]:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path_factory.mktemp("x")))
    hook = HookControl()
    released: list[str] = []
    s = TransferSender(LAYOUT, "u", HostShmPath(), released.append, lambda r: None, copy_hook=hook)
    hook.sender = s
    s.start()
    u = Unit(s, hook, released, [])
    yield u
    hook.gate.set()
    for r in u.receivers:
        r.close()
    s.close()


def test_a_dropped_offer_frees_its_source_at_once_and_is_never_pulled(unit: Unit) -> None:
    ticket = unit.offer()
    r = unit.receiver()
    t0 = time.monotonic()
    assert r.drop(ticket)
    assert transfer_fakes.wait_for(lambda: ticket.transfer_id in unit.released, DROP_BOUND_S)
    print(f"\nDROP -> P's pages back in {(time.monotonic() - t0) * 1e3:.1f} ms")
    assert unit.s.stats().offers_dropped == 1 and unit.s.stats().offers_open == 0
    assert r.stats().drops_sent == 1
    late = r.request(ticket, 5.0)  # a PULL after the drop is refused: no copy for it ever starts
    assert transfer_fakes.wait_for(lambda: r.poll(late) is TransferState.FAILED)
    assert isinstance(late.error, UnknownTransfer) and "ABORTED" in str(late.error)
    r.complete(late)
    assert unit.released.count(ticket.transfer_id) == 1


def test_a_drop_naming_another_p_instance_is_refused_and_logged(
    unit: Unit, caplog: pytest.LogCaptureFixture
) -> None:
    """A ticket of an earlier (or forged) P instance at the slot never ends this instance's offer."""
    ticket = unit.offer()
    r = unit.receiver()
    forged = dataclasses.replace(ticket, instance_id=secrets.token_hex(16))
    with caplog.at_level(logging.INFO):
        assert r.drop(forged)  # D cannot know; P checks
        # D connects, sees P's instance differ from the ticket's and forgets it: nothing is sent
        assert transfer_fakes.wait_for(lambda: r.stats().drops_sent == 0 and unit.s.stats().connections == 1)
        time.sleep(0.2)
    assert unit.s.stats().offers_dropped == 0 and ticket.transfer_id not in unit.released
    # the frame itself, as a peer that ignores D's own check would send it: P refuses and logs
    raw = _raw_drop(unit, ticket.transfer_id, forged.instance_id)
    assert transfer_fakes.wait_for(lambda: unit.s.stats().drops_refused == 1)
    assert ticket.transfer_id not in unit.released and unit.s.stats().offers_open == 1
    assert any("refused DROP" in m and "names P instance" in m for m in _messages(caplog)), _messages(caplog)
    raw.close()
    h = r.request(ticket, 5.0)  # the real offer still serves its puller
    assert transfer_fakes.wait_for(lambda: r.poll(h) is TransferState.VERIFIED)
    r.complete(h)


def test_a_drop_of_an_unknown_offer_is_refused_and_logged(
    unit: Unit, caplog: pytest.LogCaptureFixture
) -> None:
    ticket = unit.offer()
    r = unit.receiver()
    unknown = dataclasses.replace(ticket, transfer_id=secrets.token_hex(16))
    with caplog.at_level(logging.INFO):
        assert r.drop(unknown)
        assert transfer_fakes.wait_for(lambda: unit.s.stats().drops_refused == 1)
    assert r.stats().drops_sent == 1 and unit.s.stats().offers_dropped == 0
    assert unit.s.stats().offers_open == 1 and ticket.transfer_id not in unit.released
    assert any("refused DROP" in m and "no such offer" in m for m in _messages(caplog)), _messages(caplog)


def test_a_drop_never_ends_an_offer_another_d_has_pulled(
    unit: Unit, caplog: pytest.LogCaptureFixture
) -> None:
    """D1 pulls (its copy is held inside P); a replayed ticket that D2 sheds sends a DROP: P refuses
    it, and D1's transfer verifies with P's pages released once, by the copy."""
    ticket = unit.offer()
    d1, d2 = unit.receiver(), unit.receiver()
    unit.hook.mode = "block"
    h = d1.request(ticket, 10.0)
    assert unit.hook.entered.wait(5.0)  # COPYING: the offer belongs to D1's transfer now
    with caplog.at_level(logging.INFO):
        assert d2.drop(ticket)
        assert transfer_fakes.wait_for(lambda: unit.s.stats().drops_refused == 1)
    assert any("refused DROP" in m and "COPYING" in m for m in _messages(caplog)), _messages(caplog)
    unit.hook.gate.set()
    assert transfer_fakes.wait_for(lambda: d1.poll(h) is TransferState.VERIFIED)
    d1.complete(h)
    assert unit.s.stats().offers_dropped == 0 and unit.released.count(ticket.transfer_id) == 1


def test_d_sends_no_drop_for_a_ticket_it_cannot_attribute_or_has_requested(
    unit: Unit, caplog: pytest.LogCaptureFixture, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ticket = unit.offer()
    r = unit.receiver()
    elsewhere = str(tmp_path_factory.mktemp("other"))
    foreign = dataclasses.replace(ticket, endpoint=f"{elsewhere}/p-x.sock", lock_path=f"{elsewhere}/p-x.lock")
    with caplog.at_level(logging.INFO):
        assert not r.drop(foreign)  # another unit's endpoint: D never connects to it
        h = r.request(ticket, 5.0)
        assert not r.drop(ticket)  # requested: its transfer ends by its own rules
    assert any("no DROP" in m and "not in this unit" in m for m in _messages(caplog)), _messages(caplog)
    assert r.stats().drops_refused == 2 and r.stats().drops_sent == 0
    assert transfer_fakes.wait_for(lambda: r.poll(h) is TransferState.VERIFIED)
    r.complete(h)
    unit.receivers.remove(r)
    r.close()
    assert not r.drop(unit.offer(seed=1))  # closed


def test_drops_for_an_unreachable_p_are_forgotten_and_the_ttl_stays_the_backstop(unit: Unit) -> None:
    """No P at the endpoint: the DROP is queued, the connect fails, and it is forgotten (nothing
    retries forever); D goes on serving other endpoints."""
    ticket = unit.offer()
    r = unit.receiver()
    gone = dataclasses.replace(ticket, endpoint=ticket.endpoint.replace("p-p0.sock", "p-none.sock"))
    assert r.drop(gone)
    assert transfer_fakes.wait_for(
        lambda: not r._book.endpoints.get(gone.endpoint) or not r._book.endpoints[gone.endpoint].drops
    )
    assert r.stats().drops_sent == 0
    assert r.drop(ticket)  # the live P still hears its own
    assert transfer_fakes.wait_for(lambda: ticket.transfer_id in unit.released, DROP_BOUND_S)


def _raw_drop(unit: Unit, tid: str, instance: str):
    """A connection that completed HELLO (as any D of the unit can) and sent one DROP frame."""
    from tandem.transfer._conn import Connection
    from tandem.transfer.control import connect_unix
    from tandem.transfer.frames import PROTOCOL_VERSION, MsgType

    arena = HostShmPath().create_arena(ARENA, "raw")
    exp = arena.export()
    conn = Connection(connect_unix(unit.s.endpoint, 1.0))
    conn.send(
        MsgType.HELLO,
        fds=exp.fds,
        v=PROTOCOL_VERSION,
        layout=LAYOUT.to_dict(),
        layout_fp=LAYOUT.fingerprint(),
        path="host_shm",
        arena=exp.meta,
        d_instance="d" * 32,
    )
    kind, _, _ = conn.reader.read()
    assert kind is MsgType.HELLO_ACK
    conn.send(MsgType.DROP, tid=tid, instance=instance)
    return _Closer(conn, arena)


@dataclasses.dataclass
class _Closer:
    conn: object
    arena: object

    def close(self) -> None:
        self.conn.finish()  # type: ignore[attr-defined]
        self.arena.close()  # type: ignore[attr-defined]


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]
