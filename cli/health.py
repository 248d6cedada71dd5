"""tandem-health: is this unit ready to take new streams? (the pod's readiness probe)

Exit status: 0 ready (every engine up, none draining); 1 not ready (the reasons are printed);
2 the metrics endpoint could not be read. `--allow-draining` answers for liveness-style checks that
only care whether the engines answer.
"""

from __future__ import annotations

import argparse
import sys

from tandem.serving.health import HealthUnavailable, fetch_health


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-health", description=__doc__.splitlines()[0])
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the scrape")
    ap.add_argument("--allow-draining", action="store_true", help="a draining unit counts as healthy")
    args = ap.parse_args(argv)
    try:
        health = fetch_health(args.metrics_url, args.timeout)
    except HealthUnavailable as exc:
        print(f"unavailable: {exc}", file=sys.stderr)
        return 2
    ok = health.engines_up if args.allow_draining else health.ready
    for reason in health.reasons:
        print(reason, file=sys.stderr)
    print("ready" if ok else "not ready")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
