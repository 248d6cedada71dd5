"""tandem-gateway: OpenAI's speech API (`POST /v1/audio/speech`) in front of the unit's Triton.

    tandem-gateway --triton HOST:GRPC_PORT --port HTTP_PORT [--metrics-url URL] [--models tts,tts_mono]
                   [--max-connections N] [--max-connections-per-client N] [--header-timeout S]
                   [--body-timeout S] [--aliases FILE] [--api-keys FILE]

Speaks Triton gRPC streaming to the models (one stream id per request, set for the caller) and
streams their audio to HTTP callers as it is produced; `gateway/app.py` documents the routes,
`gateway/serve.py` the HTTP server's bounds.
"""

from __future__ import annotations

import argparse
import os
import sys

from tandem.gateway.aliases import Aliases
from tandem.gateway.app import GatewaySettings, create_app
from tandem.gateway.forwarded import parse_trusted
from tandem.gateway.serve import ServerLimits, serve
from tandem.gateway.tenants import ENV, ApiKeys


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
        "--lost-after",
        type=float,
        default=5.0,
        help="seconds without a response after which a stream whose path has a dead stub (by the unit's"
        " metrics) ends at once instead of at --idle-timeout",
    )
    ap.add_argument(
        "--ws-idle-timeout",
        type=float,
        default=60.0,
        help="a stream-input WebSocket's default inactivity_timeout (its config may set 1-600 s): seconds"
        " without a frame or ping while nothing speaks before it is closed",
    )
    ap.add_argument(
        "--ws-max-pending-chars",
        type=int,
        default=8192,
        help="a WebSocket turn's unspoken characters at most (a text frame past it is refused)",
    )
    ap.add_argument(
        "--aliases",
        default=None,
        help="JSON file of model and voice aliases replacing the defaults (tts-1 -> the first of --models,"
        " OpenAI's voice names -> the model's built-in voices; gateway/aliases.py)",
    )
    ap.add_argument(
        "--api-keys",
        default=os.environ.get(ENV) or None,
        help=f"file of `TENANT KEY` lines: callers need `Authorization: Bearer KEY` and see only their"
        f" tenant's voices (default: ${ENV}; neither: open development mode; gateway/tenants.py)",
    )
    d = ServerLimits()
    ap.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open connections past which a new one is refused (503); clamped below the open-files limit",
    )
    ap.add_argument(
        "--max-connections-per-client",
        type=int,
        default=d.max_per_client,
        help="connections from one peer address past which a new one is refused (503); from a trusted"
        " proxy, requests in flight per forwarded client",
    )
    ap.add_argument(
        "--trusted-proxies",
        default="",
        help="IPs/CIDRs (comma-separated) of routers whose X-Forwarded-For names the client: the cap per"
        " client keys on it, never on the router (gateway/forwarded.py); default none: the header is ignored",
    )
    ap.add_argument(
        "--header-timeout", type=float, default=d.header_timeout_s, help="seconds a request's head may take"
    )
    ap.add_argument(
        "--body-timeout", type=float, default=d.body_timeout_s, help="seconds a request's body may take"
    )
    ap.add_argument(
        "--write-timeout",
        type=float,
        default=d.write_timeout_s,
        help="seconds a client may read nothing while a response or WebSocket waits to send, then cut",
    )
    args = ap.parse_args(argv)
    try:
        aliases = Aliases.from_file(args.aliases) if args.aliases else Aliases()
        keys = ApiKeys.from_file(args.api_keys) if args.api_keys else ApiKeys({})
        trusted = parse_trusted(args.trusted_proxies)
    except ValueError as exc:
        ap.error(str(exc))
    host = args.triton.rsplit(":", 1)[0]
    settings = GatewaySettings(
        triton_url=args.triton,
        metrics_url=args.metrics_url or f"http://{host}:8002/metrics",
        models=tuple(m for m in args.models.split(",") if m),
        idle_timeout_s=args.idle_timeout,
        lost_after_s=args.lost_after,
        ws_idle_timeout_s=args.ws_idle_timeout,
        ws_max_pending_chars=args.ws_max_pending_chars,
        aliases=aliases,
        api_keys=keys,
    )
    limits = ServerLimits(
        max_connections=args.max_connections,
        max_per_client=args.max_connections_per_client,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        write_timeout_s=args.write_timeout,
        trusted_proxies=trusted,
    )
    serve(create_app(settings), args.host, args.port, limits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
