"""Test support (fault injection), importable by spawn children: never used by production code.

`sender_child` runs a `TransferSender` in its own process, driven over a multiprocessing pipe, so tests
can SIGSTOP, SIGKILL and restart a real P; `SenderProcess` starts and drives one from the test.
`FailingPath` is a path whose probe always fails.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from multiprocessing.connection import Connection as Pipe
from typing import Any

import torch

from tandem.transfer.errors import PathUnavailable
from tandem.transfer.layout import WireLayout
from tandem.transfer.paths.base import LocalArena, PeerArena, TransferPath
from tandem.transfer.paths.registry import path_factories
from tandem.transfer.sender import TransferSender
from tandem.transfer.state import Ticket


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll `pred` every 5 ms until it holds or `timeout` passes; returns its last value (tests only)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and not pred():
        time.sleep(0.005)
    return pred()


def fake_kv(layout: WireLayout, n_tokens: int, seed: int) -> torch.Tensor:
    """Deterministic KV of `staging_shape(n_tokens)`: the same bytes in every process for one seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.staging_shape(n_tokens), generator=g).to(layout.dtype)


def fake_pool(layout: WireLayout, n_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A P pool of 2 x `n_tokens` slots holding `fake_kv(layout, n_tokens, seed)` at shuffled slots
    (every row its own chunk), and those slots: what an offer's `rows` look like on a real P."""
    g = torch.Generator().manual_seed(seed ^ 0x5EED)
    slots = torch.randperm(2 * n_tokens, generator=g)[:n_tokens]
    pool = torch.zeros(layout.staging_shape(2 * n_tokens), dtype=layout.dtype)
    pool.index_copy_(2, slots, fake_kv(layout, n_tokens, seed))
    return pool, slots


class HookControl:
    """What the sender's `copy_hook` does: "none", "block" (every copy, until `release`), "block_one"
    (only the first copy to enter after the mode was set, until `release`; later copies pass), or
    "until_abort" (until the sender holds an ABORT_ACK for the copy, so the ACK — not DONE — is what
    answers D). `set_mode` also re-arms "block_one" and clears `entered`."""

    def __init__(self) -> None:
        self.mode = "none"
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.sender: TransferSender | None = None
        self._blocked: str | None = None
        self._lock = threading.Lock()

    def set_mode(self, mode: str) -> None:
        with self._lock:
            self.mode, self._blocked = mode, None
            self.entered.clear()

    def __call__(self, tid: str, staging: object = None) -> None:
        with self._lock:
            if self.mode == "block_one" and self._blocked is None:
                self._blocked = tid
        self.entered.set()
        if self.mode == "block" or (self.mode == "block_one" and tid == self._blocked):
            self.gate.wait()
        elif self.mode == "until_abort":
            end = time.monotonic() + 30.0
            while self.sender is not None and self.sender.stats().held_acks == 0 and time.monotonic() < end:
                time.sleep(0.005)


def sender_child(
    unit: str,
    slot: str,
    layout: dict[str, object],
    xdg_dir: str,
    pipe: Pipe,
    path: str = "host_shm",
    control: str = "unix",
    secret: bytes | None = None,
) -> None:
    """Entry point of a P child process serving over `path_factories()[path]`, its control plane on `control`
    ("tcp": loopback, with the unit `secret`). Commands (tuples) on `pipe`:
    ("offer", n_tokens, seed, ttl_s) -> ticket json; ("hook", mode) / ("release",) -> "ok";
    ("entered", timeout_s) -> bool;
    ("stats",) -> dict (with "sources_released"); ("close",) -> "closed" and the process exits."""
    os.environ["XDG_RUNTIME_DIR"] = xdg_dir
    wl = WireLayout.from_dict(layout)
    hook = HookControl()
    released: list[str] = []
    fatal: list[str] = []
    sender = TransferSender(
        wl,
        unit,
        path_factories()[path](),
        released.append,
        fatal.append,
        slot=slot,
        copy_hook=hook,
        control=control,
        secret=secret,
    )
    hook.sender = sender
    sender.start()
    pipe.send(("ready", sender.instance_id, sender.endpoint))
    while True:
        cmd = pipe.recv()
        if cmd[0] == "offer":
            _, n_tokens, seed, ttl_s = cmd
            pool, slots = fake_pool(wl, n_tokens, seed)

            def gather(out: torch.Tensor, p: torch.Tensor = pool, s: torch.Tensor = slots) -> None:
                out.copy_(p.index_select(2, s))

            pipe.send(sender.offer(n_tokens, gather, ttl_s, rows=(pool, slots)).to_json())
        elif cmd[0] == "hook":
            hook.set_mode(cmd[1])
            pipe.send("ok")
        elif cmd[0] == "release":
            hook.gate.set()
            pipe.send("ok")
        elif cmd[0] == "entered":
            pipe.send(hook.entered.wait(float(cmd[1])))
        elif cmd[0] == "stats":
            pipe.send({**asdict(sender.stats()), "sources_released": len(released), "fatal": list(fatal)})
        elif cmd[0] == "close":
            hook.gate.set()
            sender.close()
            pipe.send("closed")
            return


class SenderProcess:
    """A P child (`sender_child`) started with spawn, driven from the test over its pipe."""

    def __init__(
        self,
        unit: str,
        xdg: str,
        layout: WireLayout,
        slot: str = "p0",
        path: str = "host_shm",
        control: str = "unix",
        secret: bytes | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        args = (unit, slot, layout.to_dict(), xdg, child, path, control, secret)
        self.proc = ctx.Process(target=sender_child, args=args, daemon=True)
        self.proc.start()
        assert self.pipe.poll(60), "P child did not start"
        _, self.instance, self.endpoint = self.pipe.recv()

    def call(self, *cmd: Any) -> Any:
        self.pipe.send(cmd)
        return self.pipe.recv()

    def offer(self, n: int, seed: int, ttl: float = 30.0) -> Ticket:
        return Ticket.from_json(self.call("offer", n, seed, ttl))

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        """Resume it if stopped, close the sender, and wait for the exit (kill after 10 s)."""
        if self.proc.is_alive() and self.proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.pipe.send(("close",))
            if self.pipe.poll(10):
                self.pipe.recv()
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class FailingPath(TransferPath):
    """A path whose probe fails, for `select_path` tests; every data method raises too."""

    name = "failing"

    def probe(self) -> None:
        raise PathUnavailable("failing path: probe always fails")

    def create_arena(self, nbytes: int, label: str) -> LocalArena:
        raise PathUnavailable("failing path")

    def open_peer_arena(self, meta: Mapping[str, object], fds: list[int]) -> PeerArena:
        raise PathUnavailable("failing path")

    def alloc_staging(self, layout: WireLayout, n_tokens: int) -> torch.Tensor:
        raise PathUnavailable("failing path")

    def copy_to_peer(self, staging: torch.Tensor, peer: PeerArena, offset: int, tid: str = "") -> None:
        raise PathUnavailable("failing path")


__all__ = ["FailingPath", "HookControl", "SenderProcess", "fake_kv", "fake_pool", "sender_child"]
