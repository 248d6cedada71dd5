"""`make serve`'s one ready line: waits until the gateway's `/health` says the unit is ready (Triton
answers, every engine up, nothing draining: `gateway/app.py`), then prints where everything listens.

    python -m tandem.cli.ready --gateway http://127.0.0.1:8080 --grpc 127.0.0.1:8001 \
        --http 127.0.0.1:8000 --metrics 127.0.0.1:8002 [--timeout S] [--pid PID]

Exits 0 once it printed the line; 1 when `--pid` (the unit) exits first or `--timeout` passes (then
it says so).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.cli.ready", description=__doc__.splitlines()[0])
    ap.add_argument("--gateway", required=True, help="the gateway's base URL")
    ap.add_argument("--grpc", required=True, help="Triton's gRPC address")
    ap.add_argument("--http", required=True, help="Triton's HTTP address")
    ap.add_argument("--metrics", required=True, help="Triton's metrics address")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait at most")
    ap.add_argument("--pid", type=int, default=None, help="stop waiting when this process exits")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    while _alive(args.pid):
        try:
            with urllib.request.urlopen(f"{args.gateway}/health", timeout=2) as r:
                if r.status == 200:
                    print(
                        f"tandem: ready: OpenAI speech API {args.gateway}/v1 (WebSocket "
                        f"{args.gateway.replace('http', 'ws', 1)}/v1/audio/speech/stream-input), Triton gRPC "
                        f"{args.grpc}, HTTP {args.http}, metrics http://{args.metrics}/metrics",
                        flush=True,
                    )
                    return 0
        except (urllib.error.URLError, OSError):
            pass  # not up yet (503 is an HTTPError, a URLError)
        if time.monotonic() > deadline:
            print(f"tandem: not ready after {args.timeout:g} s ({args.gateway}/health)", file=sys.stderr)
            return 1
        time.sleep(1.0)  # a person waits for this line: once a second is soon enough
    return 1


if __name__ == "__main__":
    sys.exit(main())
