"""The tritonserver arguments `tandem-unit` reads and adds (nothing here imports Triton or torch).

What it adds unless the caller gave its own: `--model-control-mode=explicit --load-model=*` (the unit
loads and reloads models through the repository API), loopback addresses (Triton's own default is
every interface), `--exit-timeout-secs` (the drain bound), `--disable-auto-complete-config` (the
shipped configs are complete; completing them started one more stub per model load, importing the
model's code, about 11 s of a 2-core machine for every load and reload) and a python-backend
shared-memory prefix of the unit's (supervisor.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

LOOPBACK = "127.0.0.1"
SHM_PREFIX_OPTION = "shm-region-prefix-name"


def option_values(args: Sequence[str], *names: str) -> list[str]:
    """Every value of `--name=value` / `--name value` in `args`, in order."""
    out = []
    for i, arg in enumerate(args):
        for name in names:
            if arg.startswith(name + "="):
                out.append(arg[len(name) + 1 :])
            elif arg == name and i + 1 < len(args):
                out.append(args[i + 1])
    return out


def with_explicit_control(args: Sequence[str]) -> list[str]:
    """`args` plus `--model-control-mode=explicit --load-model=*` unless a model-control mode is given."""
    if option_values(args, "--model-control-mode"):
        return list(args)
    return [*args, "--model-control-mode=explicit", "--load-model=*"]


def with_loopback(args: Sequence[str]) -> list[str]:
    """`args` plus `--<api>-address=127.0.0.1` for each of grpc, http, metrics not given an address
    (Triton's own default is every interface)."""
    out = list(args)
    for api in ("grpc", "http", "metrics"):
        if not option_values(args, f"--{api}-address"):
            out.append(f"--{api}-address={LOOPBACK}")
    return out


def with_exit_timeout(args: Sequence[str], drain_s: float) -> list[str]:
    """`args` plus `--exit-timeout-secs` (how long Triton drains in-flight requests on SIGTERM)."""
    if option_values(args, "--exit-timeout-secs"):
        return list(args)
    return [*args, f"--exit-timeout-secs={max(1, round(drain_s))}"]


def shm_prefix(args: Sequence[str]) -> str | None:
    """The python backend's shared-memory prefix given in `args`, if any."""
    for value in option_values(args, "--backend-config"):
        backend, _, setting = value.partition(",")
        key, _, prefix = setting.partition("=")
        if backend == "python" and key == SHM_PREFIX_OPTION:
            return prefix
    return None


def http_base(args: Sequence[str]) -> str:
    port = (option_values(args, "--http-port") or ["8000"])[-1]
    host = (option_values(args, "--http-address") or ["127.0.0.1"])[-1]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{port}"


def metrics_url(args: Sequence[str]) -> str:
    """The server's Prometheus endpoint, where the engines publish `tandem_engine_up`."""
    port = (option_values(args, "--metrics-port") or ["8002"])[-1]
    host = (option_values(args, "--metrics-address") or ["127.0.0.1"])[-1]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{port}/metrics"


def find_model_dir(args: Sequence[str], model: str) -> Path | None:
    """`<repository>/<model>` for the first local repository (of the server's args) that holds `model`."""
    for repo in option_values(args, "--model-repository", "--model-store"):
        candidate = Path(repo) / model
        if (candidate / "config.pbtxt").is_file():
            return candidate
    return None


def with_auto_complete_off(args: Sequence[str]) -> list[str]:
    """`args` plus `--disable-auto-complete-config` unless the caller set config completion either way
    (`--disable-auto-complete-config`, `--strict-model-config`)."""
    if option_values(args, "--strict-model-config") or "--disable-auto-complete-config" in args:
        return list(args)
    return [*args, "--disable-auto-complete-config"]


def strict_readiness(args: Sequence[str]) -> bool:
    """Whether Triton's readiness covers every model (`--strict-readiness`, true by default)."""
    values = option_values(args, "--strict-readiness")
    return not values or values[-1].strip().lower() not in ("false", "0", "no", "off")
