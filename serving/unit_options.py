"""`tandem-unit`'s own options (those before `--`), and the tritonserver arguments after it.

Called once by `tandem-unit`'s `main` (serving/supervisor.py), which hands both to its `Supervisor`.
It owns each option's default and help; a command line without server arguments exits with
argparse's usage error (status 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tandem.serving import mps
from tandem.serving.api_key import UNIT_PARAMETER


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="tandem-unit",
        usage="tandem-unit [options] -- <tritonserver args...>",
        description="Run one unit's tritonserver; restart it when it dies or its engines stay down.",
    )
    parser.add_argument(
        "--engine-down-grace",
        type=float,
        default=120.0,
        help="seconds an engine may stay down (its stub restarting it) before the server is restarted",
    )
    parser.add_argument(
        "--max-server-restarts", type=int, default=3, help="server restarts per minute before giving up"
    )
    parser.add_argument(
        "--stop-timeout", type=float, default=12.0, help="seconds after SIGTERM before the tree is killed"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=8.0,
        help="Triton's --exit-timeout-secs unless given: how long a stopping server drains requests",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        help="what the unit keeps across restarts (registered voices: DIR/voices, unless the models set "
        "tandem.voices.dir); default: $XDG_STATE_HOME/tandem/units/<unit>",
    )
    parser.add_argument("--probe-interval", type=float, default=2.0, help="seconds between liveness probes")
    parser.add_argument("--probe-timeout", type=float, default=3.0, help="seconds each probe may take")
    parser.add_argument(
        "--probe-failures",
        type=int,
        default=5,
        help="failed liveness probes in a row before the server's tree is killed and restarted",
    )
    parser.add_argument(
        "--reload-timeout", type=float, default=600.0, help="seconds one model reload may take"
    )
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between checks")
    parser.add_argument(
        "--prefill-model", default="prefill", help=f"the model whose {UNIT_PARAMETER} names the unit"
    )
    parser.add_argument(
        "--proxy", action="store_true", help="run the unit's tandem-proxy sidecar (the proxy KV path)"
    )
    parser.add_argument(
        "--mps",
        type=mps.parse_mode,
        default=mps.MpsMode.AUTO,
        help="CUDA MPS for engines sharing a GPU (serving/mps.py): off, auto (on where they share one "
        "and nvidia-cuda-mps-control exists), on (refuse to start without it)",
    )
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        own, server = argv[:i], argv[i + 1 :]
    else:
        own, server = argv, []
    opts = parser.parse_args(own)
    if not server:
        parser.error("give the tritonserver arguments after `--`")
    return opts, server
