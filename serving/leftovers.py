"""What a unit's stopped or crashed server leaves behind, and the lock that makes removing it safe.

Called by `tandem-unit`'s supervisor (serving/supervisor.py) and its server process
(serving/server_process.py), on their one thread. It owns:

* the unit's lock (`<unit dir>/unit.lock`, `take_unit_lock`): flocked for the supervisor's life, so
  a second supervisor of the same unit fails at start (`UnitTaken`, naming the setting to change),
  and every region of the unit's shared-memory prefix belongs to a server of this supervisor's;
* the python backend's `/dev/shm` regions of that prefix (`Regions`): made 0600 while the server
  runs (Triton creates them 0644), removed when it is gone;
* the processes a dead server leaves (`kill_leftovers`): its process group and every stub and worker
  seen in its tree, SIGKILLed (an orphaned P keeps its slot lock, and the next server's P could not
  start).

Failure here is not an error of the unit: a region or a process that is already gone, or that the
user may not touch, is skipped; only a taken unit lock stops the supervisor from starting.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.serving import process_tree
from tandem.serving.api_key import UNIT_PARAMETER


class UnitTaken(Exception):
    """Another supervisor holds this unit's lock."""


def take_unit_lock(unit_dir: Path, unit: str, model: str) -> int:
    """flock `<unit dir>/unit.lock` for this process's life (the fd is returned, close-on-exec);
    UnitTaken if another holds it. `model` is the one whose `UNIT_PARAMETER` names the unit."""
    path = unit_dir / "unit.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UnitTaken(
            f"another tandem-unit serves unit {unit!r} ({path} is locked): give this one "
            f"another unit name (the `{UNIT_PARAMETER}` parameter of its `{model}` model, "
            f"e.g. `tandem-repo --set prefill:{UNIT_PARAMETER}=NAME "
            f"--set decode:{UNIT_PARAMETER}=NAME`) "
            "or another XDG_RUNTIME_DIR"
        ) from None
    return fd


class Regions:
    """The python backend's /dev/shm regions of one unit's prefix (`tandem_<uid>_<unit>_<tag>_`)."""

    def __init__(self, prefix: str, log: Callable[[str], None]) -> None:
        self.prefix = prefix
        self.log = log

    def _paths(self) -> list[str]:
        return glob.glob(f"/dev/shm/{glob.escape(self.prefix)}*")

    def make_private(self) -> None:
        """chmod 0600 every region of this unit's prefix (Triton creates them 0644; each stub makes
        its own private at start, serving/stub_guard.py: this covers any other)."""
        for path in self._paths():
            with contextlib.suppress(OSError):
                if os.stat(path).st_mode & 0o077:
                    os.chmod(path, 0o600)

    def remove(self) -> None:
        """Remove the regions of this unit's (stopped) server."""
        removed = 0
        for path in self._paths():
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
        if removed:
            self.log(f"removed {removed} shared-memory regions /dev/shm/{self.prefix}* of the stopped server")


def kill_leftovers(server_pid: int, tree: Sequence[int], log: Callable[[str], None]) -> None:
    """SIGKILL what is left of the exited server `server_pid`: its process group (the server and
    its stubs share one session) and every process of `tree` (seen below it while it ran: workers
    may have left the group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server_pid, 0)
        log(f"killing the leftover processes of tritonserver {server_pid} (its stubs, their workers)")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server_pid, signal.SIGKILL)
    stragglers = process_tree.kill_all(list(tree))
    if stragglers:
        log(f"killed {len(stragglers)} processes of tritonserver {server_pid} outside its group")
