"""`tandem-engine <model> <instance> --kind KIND --fd N`: one model instance's engine worker.

Started by that instance's Triton stub (`serving/engine_worker.py`), never by hand: file descriptor N
is the stub's end of a private socket pair (`backend/worker/channel.py`), and the engine's settings come from
the stub's Init message. The process title reads `tandem-engine <model> <instance> --kind KIND` (so
`ps` and `pgrep -f 'tandem-engine decode'` find it); its log lines, on the stub's stderr (Triton's log),
carry the instance and pid. It exits when the stub sends Stop or the channel ends (the stub is gone),
with `EXIT_FOR_PROOF` (70) when P exits for proof, 1 when the engine could not start.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from tandem.backend.worker.channel import Channel, EngineKind


def _title(argv: Sequence[str]) -> None:
    try:
        import setproctitle
    except ImportError:  # the title then reads `python -m tandem.backend.worker.main <model> <instance> ...`
        return
    setproctitle.setproctitle(" ".join(["tandem-engine", *argv]))


def main(argv: Sequence[str] | None = None) -> None:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="tandem-engine", description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("instance")
    parser.add_argument("--kind", required=True, choices=[k.value for k in EngineKind])
    parser.add_argument("--fd", type=int, required=True, help="the stub's socket (inherited)")
    opts = parser.parse_args(args_in)
    # The stub alone ends this process (Stop, or the channel's end when it dies). A SIGTERM/SIGINT to
    # the server's process group (a server shutting down) must not kill the worker before its stub's
    # finalize() stops it, or the stub would see a death and restart it. SIGKILL still works.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
