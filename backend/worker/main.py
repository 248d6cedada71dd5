"""`tandem-engine <model> <instance> --kind KIND --fd N`: one model instance's engine worker.

Started by that instance's Triton stub (`serving/engine_worker.py`), never by hand: file descriptor N
is the stub's end of a private socket pair (`backend/worker/channel.py`), and the engine's settings come from
the stub's Init message. The process title reads `tandem-engine <model> <instance> --kind KIND` (so
`ps` and `pgrep -f 'tandem-engine decode'` find it); its log lines, on the stub's stderr (Triton's log),
carry the instance and pid. It exits when the stub sends Stop or the channel ends (the stub is gone),
when its parent is no longer the stub that started it (checked every second), or `TERM_GRACE_S` after
a SIGTERM/SIGINT its stub did not follow with Stop; with `EXIT_FOR_PROOF` (70) when P exits for
proof, 1 when the engine could not start.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

from tandem.backend.worker.channel import Channel, EngineKind


def _title(argv: Sequence[str]) -> None:
    try:
        import setproctitle
    except ImportError:  # the title then reads `python -m tandem.backend.worker.main <model> <instance> ...`
        return
    setproctitle.setproctitle(" ".join(["tandem-engine", *argv]))


TERM_GRACE_S = 10.0  # a stopping server's stub sends Stop well within this (its finalize())
WATCH_S = 1.0


def _exit_later(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM/SIGINT: the stub stops this worker (Stop) as its server shuts down; if it does not
    within TERM_GRACE_S (a stray signal to the group of a server that is gone), exit anyway."""
    timer = threading.Timer(TERM_GRACE_S, os._exit, (0,))
    timer.daemon = True
    timer.start()


def _watch_parent(stub: int) -> None:
    """Exit once reparented: the stub that started this worker is gone."""
    while True:
        time.sleep(WATCH_S)
        if os.getppid() != stub:
            print(f"tandem-engine pid {os.getpid()}: its stub (pid {stub}) is gone; exiting", file=sys.stderr)
            os._exit(0)


def main(argv: Sequence[str] | None = None) -> None:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tandem-engine", description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("instance")
    parser.add_argument("--kind", required=True, choices=[k.value for k in EngineKind])
    parser.add_argument("--fd", type=int, required=True, help="the stub's socket (inherited)")
    opts = parser.parse_args(args_in)
    # The stub ends this process (Stop, or the channel's end when it dies). A SIGTERM/SIGINT to the
    # server's process group (a server shutting down) must not kill the worker before its stub's
    # finalize() stops it, or the stub would see a death and restart it: it only arms an exit
    # TERM_GRACE_S later. SIGKILL still works.
    signal.signal(signal.SIGTERM, _exit_later)
    signal.signal(signal.SIGINT, _exit_later)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    _title([a for a in args_in if not a.startswith("--fd") and a != str(opts.fd)])
    log = logging.getLogger("tandem")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s tandem[{opts.model} {opts.instance} pid {os.getpid()}] %(levelname)s %(message)s"
        )
    )
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    sock = socket.socket(fileno=opts.fd)
    from tandem.backend.worker.host import run  # imports torch: after the title is set

    status = run(Channel(sock, f"{opts.instance}-worker"))
    sys.stderr.flush()
    os._exit(status)  # engine threads are daemons; do not wait on interpreter teardown


if __name__ == "__main__":
    main()
