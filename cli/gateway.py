"""tandem-gateway: OpenAI's speech API (`POST /v1/audio/speech`) in front of the unit's Triton.

    tandem-gateway --triton HOST:GRPC_PORT --port HTTP_PORT [--metrics-url URL] [--models tts,tts_mono]

Speaks Triton gRPC streaming to the models (one stream id per request, set for the caller) and
streams their audio to HTTP callers as it is produced; `gateway/app.py` documents the routes.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from tandem.gateway.app import GatewaySettings, create_app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-gateway", description=__doc__.splitlines()[0])
    ap.add_argument("--triton", default="127.0.0.1:8001", help="Triton's gRPC endpoint, HOST:PORT")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    ap.add_argument("--port", type=int, default=8080, help="HTTP port")
    ap.add_argument(
        "--metrics-url",
        default=None,
        help="Triton's metrics endpoint for /health (default: http://<triton host>:8002/metrics)",
    )
    ap.add_argument("--models", default="tts,tts_mono", help="comma-separated models to serve")
    ap.add_argument(
        "--idle-timeout", type=float, default=60.0, help="seconds without a response that end a stream"
    )
    ap.add_argument(
        "--ws-idle-timeout",
        type=float,
        default=60.0,
        help="seconds a stream-input WebSocket may send nothing while nothing speaks before it is closed",
    )
    ap.add_argument(
        "--ws-max-pending-chars",
        type=int,
        default=8192,
        help="a WebSocket turn's unspoken characters at most (a text frame past it is refused)",
    )
    args = ap.parse_args(argv)
    host = args.triton.rsplit(":", 1)[0]
    settings = GatewaySettings(
        triton_url=args.triton,
        metrics_url=args.metrics_url or f"http://{host}:8002/metrics",
        models=tuple(m for m in args.models.split(",") if m),
        idle_timeout_s=args.idle_timeout,
        ws_idle_timeout_s=args.ws_idle_timeout,
        ws_max_pending_chars=args.ws_max_pending_chars,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
