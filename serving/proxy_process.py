"""The unit's IPC proxy sidecar (`tandem-proxy`, the `proxy` KV path) under `tandem-unit --proxy`.

Called by `tandem-unit`'s supervisor (serving/supervisor.py) on its main thread: started before the
server and checked every `--poll-interval` for as long as the server runs, stopped last. It owns the
sidecar's process (transfer/paths/proxy_sidecar.py), which dies with the supervisor
(PR_SET_PDEATHSIG).

Failure: a proxy that does not print its ready line within 60 s is killed and `start` raises
`GiveUp` with its exit status. A proxy that exits takes every P and D registration with it (D's
arena, P's staging: they are not re-made), so the supervisor starts a new one and then restarts the
server, whose P and D register again.
"""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Callable

from tandem.serving.server_process import GiveUp, die_with_parent_fn, exit_status

READY_WAIT_S = 60.0


class ProxyProcess:
    def __init__(self, unit: str, log: Callable[[str], None]) -> None:
        self.unit = unit
        self.log = log
        self.proc: subprocess.Popen[str] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start `tandem-proxy` for this unit and wait for its ready line (GiveUp if it never comes)."""
        argv = [sys.executable, "-m", "tandem.transfer.paths.proxy_sidecar", "--unit", self.unit]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent_fn()
        )
        self.starts += 1
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_WAIT_S)
        line = self.proc.stdout.readline() if ready else ""  # one line when it serves, then only logs
        if "ready" not in line:
            self.proc.kill()  # alive but silent (e.g. stuck starting CUDA): do not wait on it forever
            rc = self.proc.wait()
            self.log(f"tandem-proxy for unit {self.unit!r} did not start (status {rc})")
            raise GiveUp(exit_status(rc) or 1)
        self.log(f"started tandem-proxy (pid {self.proc.pid}) for unit {self.unit!r}")

    def exited(self) -> int | None:
        """The exit status of a started proxy that has exited; None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
