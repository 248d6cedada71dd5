"""`tandem-unit`'s duty to dead stubs: see each death by pid, remove its region, bring its model back.

A python-backend stub that dies (`kill -9`, the OOM killer, a crash) is left a zombie of the server;
Triton 2.51 keeps calling its model READY, answers every new request `Stub process '<instance>' is
not healthy.` and never starts another (docs/failure-semantics.md, "Stub death and a hung server").

**Seen by pid.** Every `--poll-interval` the supervisor scans `/proc` (`process_tree.stub_details`):
a stub of a repository model seen alive before and gone (or a zombie) now is dead, unless the unit
itself retired it (a stub of the model from before a reload, which the new version replaces).

**Its region goes at once.** The dead stub's python-backend region (`/dev/shm/<prefix><uuid>`, its
argv[2], known from when it lived) is unlinked: Triton removes a region only when it destroys the
instance, and an instance whose requests never end (a dead decoupled stub's) is never destroyed.

**The model comes back: a load carrying its config.** Triton 2.51 answers a plain `load` of a model
whose files did not change since it loaded them as done, and starts nothing (measured on the real
binary: `successfully loaded`, no `loading:`, the dead stub still the model's). A load whose config
differs only where Triton can update in place (the instance group) keeps the dead instance too. What
Triton must apply with a new instance is a load carrying a config that differs in a field it cannot
update in place: the unit sends the config the server runs (`GET /v2/models/<m>/config`) with one
parameter of its own, `tandem-unit.reload`, set to a new value each time (tandem reads only
`tandem.`-prefixed parameters, so the model sees no change). Triton loads a new version beside the
dead one (a new stub, a new engine worker) and the ensembles above it, then retires the old one.
This works on a repository started before as on a fresh checkout's first start, and on a read-only
repository. A failed load is retried after 1, 2, 4 ... at most 30 s while the server lives.

**Counted when a new stub serves.** The load's answer is not enough: the reload counts (in
`<unit dir>/unit-state.json`, published as `tandem_model_reloads` by every stub of the model) only
once a stub of the model that was not there before the load is alive and Triton calls the model
READY. A model Triton does not call READY when its stub dies (an operator unloaded it) is left alone.

Nothing here imports Triton or torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.serving import process_tree
from tandem.serving.control_api import ControlApi, ControlError

RELOAD_PARAMETER = "tandem-unit.reload"  # not `tandem.`: the model's settings never see it
RELOAD_BACKOFF_S = 1.0  # first retry of a failed reload; doubling, at most RELOAD_BACKOFF_MAX_S
RELOAD_BACKOFF_MAX_S = 30.0


class UnitState:
    """`<unit dir>/unit-state.json`: the reload counts the stubs publish (`TANDEM_UNIT_STATE`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reloads: dict[str, int] = {}
        self._lock = threading.Lock()
        self.write()

    def count_reload(self, model: str) -> int:
        with self._lock:
            self.reloads[model] = self.reloads.get(model, 0) + 1
            n = self.reloads[model]
        self.write()
        return n

    def write(self) -> None:
        with self._lock:
            text = json.dumps({"reloads": self.reloads})
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)


@dataclass
class Healing:
    """One model's way back after a stub death: from the death seen to a new stub serving."""

    model: str
    dead: list[int]
    seen_at: float  # monotonic
    thread: threading.Thread | None = None
    started: bool = False
    done: bool = False
    ok: bool = False
    new_pids: list[int] = field(default_factory=list)


class StubHealer:
    """Watches one server's stubs (`scan` each poll); reloads the model of a dead one on a thread."""

    def __init__(
        self,
        api: ControlApi,
        repositories: Iterable[str],
        prefix: str,
        state: UnitState,
        log: Callable[[str], None],
        reload_timeout_s: float,
    ) -> None:
        self.api = api
        self.repos = list(repositories)
        self.prefix = prefix
        self.state = state
        self.log = log
        self.reload_timeout_s = reload_timeout_s
        self.server: subprocess.Popen[bytes] | None = None
        self.stopping = threading.Event()
        self.stubs: dict[int, process_tree.Stub] = {}
        self.retired: set[int] = set()
        self.healing: dict[str, Healing] = {}
        self._lock = threading.Lock()
        self.configs: dict[str, dict[str, object]] = {}  # the last config each model was loaded with

    def reset(self, server: subprocess.Popen[bytes]) -> None:
        """A new server: nothing of the old one's stubs or reloads counts any more."""
        with self._lock:
            self.server = server
            self.stubs = {}
            self.retired = set()
            self.healing = {}
            self.configs = {}

    @property
    def down(self) -> dict[str, Healing]:
        """The models whose stub died and whose new stub does not serve yet."""
        with self._lock:
            return {m: h for m, h in self.healing.items() if not h.ok}

    def scan(self, answered: bool) -> list[str]:
        """One `/proc` scan of the server's stubs; a stub gone (or a zombie) since the last scan is
        dead, unless the unit retired it; `answered`: the server's models are loaded (before that a
        stub may come and go with a failed load, which Triton reports itself). Returns the models
        whose stub died in this scan (their regions removed, their reloads started)."""
        server = self.server
        if server is None or server.poll() is not None:
            return []
        now = process_tree.stub_details(server.pid, self.repos)
        with self._lock:
            for model, h in list(self.healing.items()):
                if h.done and h.ok and time.monotonic() - h.seen_at > 60.0:
                    del self.healing[model]  # kept a minute for readers of `down` and the log
            gone = {pid: s for pid, s in self.stubs.items() if pid not in now and pid not in self.retired}
            self.retired &= set(now)
            self.stubs = now
        if not answered:
            return []
        deaths: dict[str, list[int]] = {}
        for pid, stub in gone.items():
            deaths.setdefault(stub.model, []).append(pid)
            self._remove_region(stub)
        for model, pids in deaths.items():
            self.log(
                f"{model}: its stub (pid {', '.join(map(str, pids))}) died; reloading the model "
                "(a load carrying its config: a new stub)"
            )
            self.start(model, pids, now=False)
        return list(deaths)

    def start_pending(self) -> None:
        """Start the reloads `scan` found (after the supervisor marked the server not ready: a mark
        sent while a load runs waits for it)."""
        with self._lock:
            pending = [h for h in self.healing.values() if not h.started]
            for h in pending:
                h.started = True
        for h in pending:
            assert h.thread is not None
            h.thread.start()

    def _remove_region(self, stub: process_tree.Stub) -> None:
        region = stub.region
        if not region or "/" in region or not region.startswith(self.prefix):
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{region}")
            self.log(f"removed the dead stub's shared-memory region /dev/shm/{region}")

    def start(self, model: str, dead: list[int], now: bool = True) -> None:
        """Reload `model` on a thread of its own (`now` False: at the next `start_pending`), unless
        its reload already runs (a second death of a model being reloaded is that reload's business:
        it retires every stub it replaces)."""
        with self._lock:
            current = self.healing.get(model)
            if current is not None and not current.done:
                current.dead += dead
                return
            h = self.healing[model] = Healing(model, list(dead), time.monotonic())
            h.thread = threading.Thread(target=self._reload, args=(h,), name=f"reload-{model}", daemon=True)
            h.started = now
        if now:
            h.thread.start()

    def _alive(self) -> bool:
        return self.server is not None and self.server.poll() is None and not self.stopping.is_set()

    def _reload(self, h: Healing) -> None:
        server = self.server
        attempt = 0
        while self._alive() and server is self.server:
            try:
                if attempt == 0:
                    state, _ = self.api.index().get(h.model, ("", ""))
                    if state != "READY":
                        self.log(f"{h.model}: not reloaded: Triton calls it {state or 'unknown'}")
                        h.done = True
                        with self._lock:
                            if self.healing.get(h.model) is h:
                                del self.healing[h.model]
                        return
                self._load_anew(h)
                return
            except ControlError as exc:
                attempt += 1
                delay = min(RELOAD_BACKOFF_MAX_S, RELOAD_BACKOFF_S * 2 ** (attempt - 1))
                self.log(f"{h.model}: reload {attempt} failed ({exc}); next try in {delay:.0f} s")
                if self.stopping.wait(delay):
                    return
        h.done = True

    def _load_anew(self, h: Healing) -> None:
        """One load of `h.model` carrying its config with a new `tandem-unit.reload` value; returns
        once a new stub of the model serves (ControlError otherwise)."""
        assert self.server is not None
        before = {pid for pid, s in process_tree.stub_details(self.server.pid, self.repos).items()}
        with contextlib.suppress(ControlError):
            self.configs[h.model] = self.api.config(h.model)  # else the last one known
        config = dict(self.configs.get(h.model) or {})
        if not config:
            raise ControlError(f"{h.model}'s config cannot be read")
        params = dict(config.get("parameters") or {})  # type: ignore[call-overload]
        params[RELOAD_PARAMETER] = {"string_value": f"{time.time():.6f}"}
        config["parameters"] = params
        started = time.monotonic()
        with self._lock:  # the old version's stubs: their exits from now on are the reload's doing
            self.retired |= {pid for pid, s in self.stubs.items() if s.model == h.model}
        self.api.load(h.model, {"config": json.dumps(config)}, self.reload_timeout_s)
        states = self.api.index()
        fresh = [
            pid
            for pid, s in process_tree.stub_details(self.server.pid, self.repos).items()
            if s.model == h.model and pid not in before
        ]
        state = states.get(h.model, ("", ""))[0]
        if not fresh or state != "READY":
            raise ControlError(
                f"the load returned but no new stub of {h.model} serves "
                f"(Triton calls it {state or 'unknown'})"
            )
        n = self.state.count_reload(h.model)
        h.new_pids, h.ok, h.done = fresh, True, True
        self.log(
            f"{h.model}: reloaded in {time.monotonic() - started:.1f} s: new stub pid "
            f"{', '.join(map(str, fresh))} serves, {time.monotonic() - h.seen_at:.1f} s after its stub's "
            f"death was seen ({n} reloads)"
        )
