"""The unit's API key: only its holder may call Triton's control APIs.

Triton 2.51 answers its control APIs — load, unload and index the model repository, register shared
memory, change logging and trace settings, read statistics — for anyone who reaches its HTTP or gRPC
port; one unauthenticated `unload` stops a unit. Triton can refuse them without a header
(`--http-restricted-api` / `--grpc-restricted-protocol`, `<apis>:<header>=<value>`), so the launcher
(`serving/launcher.py`) always adds both flags for `LOCKED_APIS`, keyed on this unit's key:

* HTTP: header `tandem-api-key: <key>`; refused with 403 "This API is restricted, expecting header ...";
* gRPC: metadata `triton-grpc-protocol-tandem-api-key: <key>` (Triton adds the prefix); refused with
  UNAVAILABLE "This protocol is restricted, expecting header ...".

Health, metadata, model-config and inference stay open: clients read `tts`'s config parameters and
stream through inference (docs/security.md says who can reach what).

Where the key comes from (`resolve`, called by the launcher at every server start and by tandem-unit
for its own reloads; both read the same bytes):

* `TANDEM_API_KEY_FILE=<path>`: a file someone else owns, e.g. a mounted Kubernetes Secret; read, never
  written. 32-256 characters of `A-Z a-z 0-9 _ -` (`openssl rand -hex 32`), surrounding whitespace
  ignored;
* otherwise `<unit dir>/api.key`, where the unit dir is the transfer control dir
  `$XDG_RUNTIME_DIR/tandem-<uid>-<unit>/` (`tandem.transfer.control.control_dir`, mirrored here because
  importing `tandem.transfer` loads torch): created 0700 if missing, refused unless it is a directory of
  ours with mode 0700; the key is generated there on first start (64 hex characters, 0600, created
  atomically: the first creator wins) and refused unless it is a regular file of ours with mode 0600;
* `TANDEM_API_LOCK=off`: no restriction at all; the launcher warns at every start. Any value other than
  `on`/`off` is refused.

The key is never logged: it is on the server's command line only (Triton takes it no other way), and
`redact` replaces it wherever tandem prints that command line. Nothing here imports Triton or torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.serving.repository import model_parameter, repository_unit
from tandem.transfer.control import DEFAULT_UNIT, UNIT_PARAMETER, control_dir
from tandem.transfer.errors import UnsafeControlDir

LOCKED_APIS = ("model-repository", "shared-memory", "logging", "trace", "statistics")
HEADER = "tandem-api-key"  # the HTTP header; gRPC clients send GRPC_HEADER
GRPC_HEADER = f"triton-grpc-protocol-{HEADER}"
KEY_NAME = "api.key"
FILE_ENV = "TANDEM_API_KEY_FILE"
LOCK_ENV = "TANDEM_API_LOCK"
UNLOCKED_WARNING = (
    f"{LOCK_ENV}=off: Triton's {', '.join(LOCKED_APIS)} APIs answer anyone who reaches its HTTP and "
    "gRPC ports (one request can unload a model and stop the unit); use it only where nothing else "
    "can reach them"
)
_KEY = re.compile(r"^[A-Za-z0-9_-]{32,256}$")


class ApiKeyError(RuntimeError):
    """The key cannot be had safely: bad setting, unsafe directory or file, malformed key."""


@dataclass(frozen=True)
class ApiLock:
    """How one server start is locked. `key` None: unlocked (`TANDEM_API_LOCK=off`)."""

    key: str | None = field(repr=False)
    source: Path | None  # the file the key was read from (None when unlocked)

    @property
    def locked(self) -> bool:
        return self.key is not None

    def server_args(self) -> list[str]:
        """The tritonserver flags that lock `LOCKED_APIS` on HTTP and gRPC (none when unlocked)."""
        if self.key is None:
            return []
        rule = f"{','.join(LOCKED_APIS)}:{HEADER}={self.key}"
        return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]

    def http_headers(self) -> dict[str, str]:
        return {} if self.key is None else {HEADER: self.key}

    def grpc_headers(self) -> dict[str, str]:
        return {} if self.key is None else {GRPC_HEADER: self.key}

    def redact(self, text: str) -> str:
        """`text` with the key replaced, for anything that prints a command line."""
        return text if self.key is None else text.replace(self.key, "<api-key>")


def option_values(args: Sequence[str], name: str) -> list[str]:
    """Every value of `--name=value` / `--name value` in `args`, in order."""
    out = []
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            out.append(arg[len(name) + 1 :])
        elif arg == name and i + 1 < len(args):
            out.append(args[i + 1])
    return out


def unit_of(server_args: Sequence[str]) -> str:
    """The unit a server serves: the first `UNIT_PARAMETER` named by a model (models in name
    order, local repositories in argument order), else the first local repository's own
    (`repository_unit`, what the engines derive then: serving/engine_worker.py), else `DEFAULT_UNIT`."""
    repos = option_values(server_args, "--model-repository") + option_values(server_args, "--model-store")
    local = []
    for repo in repos:
        root = Path(repo)
        with contextlib.suppress(OSError):
            for cfg in sorted(root.glob("*/config.pbtxt")):
                local.append(root)
                unit = model_parameter(root, cfg.parent.name, UNIT_PARAMETER)
                if unit:
                    return unit
    return repository_unit(local[0]) if local else DEFAULT_UNIT


def unit_dir(unit: str, env: Mapping[str, str]) -> Path:
    """The unit's control directory (`tandem.transfer.control.control_dir`, with its checks) for the
    environment the server runs in; ApiKeyError naming what is wrong."""
    try:
        return control_dir(unit, env)
    except (ValueError, UnsafeControlDir) as exc:
        raise ApiKeyError(str(exc)) from None


def _checked(path: Path, text: str) -> str:
    key = text.strip()
    if not _KEY.match(key):
        raise ApiKeyError(
            f"{path} does not hold an API key: want 32-256 characters of A-Z a-z 0-9 _ - "
            f"(e.g. `openssl rand -hex 32`), found {len(key)} characters"
        )
    return key


def read_mounted(path: Path) -> str:
    """The key in a file someone else provides (`TANDEM_API_KEY_FILE`)."""
    try:
        return _checked(path, path.read_text(encoding="ascii", errors="replace"))
    except OSError as exc:
        raise ApiKeyError(f"{FILE_ENV}={path}: {exc.strerror or exc}") from exc


def _read_own(path: Path) -> str:
    """The generated key at `path`: a regular file of ours, mode 0600, opened without following a
    symlink. Raises FileNotFoundError if there is none yet."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ApiKeyError(f"{path} is a symlink; refused") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o600:
            raise ApiKeyError(
                f"{path} must be a regular file of uid {os.getuid()} with mode 600 "
                f"(is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); remove it to have a new key made"
            )
        return _checked(path, os.read(fd, 1024).decode("ascii", errors="replace"))
    finally:
        os.close(fd)


def generated(directory: Path) -> Path:
    """`<directory>/api.key`, made (0600, atomically) if missing; returns its path."""
    path = directory / KEY_NAME
    if os.path.lexists(path):
        return path
    tmp = directory / f".{KEY_NAME}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    with contextlib.suppress(FileExistsError):
        os.link(tmp, path)  # the first creator wins; everyone reads the winner's key
    tmp.unlink()
    return path


def resolve(server_args: Sequence[str], env: Mapping[str, str] | None = None) -> ApiLock:
    """The lock for a server started with `server_args` in environment `env` (default: ours).

    Called by the launcher before every exec and by tandem-unit before it calls the server; generates
    the unit's key on first call. Raises `ApiKeyError` (never returns a weaker lock) when the setting is
    unknown, the unit dir or key file is unsafe, or the key is malformed."""
    env = os.environ if env is None else env
    mode = env.get(LOCK_ENV, "on").strip().lower()
    if mode == "off":
        return ApiLock(key=None, source=None)
    if mode != "on":
        raise ApiKeyError(f"{LOCK_ENV}={env[LOCK_ENV]!r}: want `on` (the default) or `off`")
    mounted = env.get(FILE_ENV, "").strip()
    if mounted:
        path = Path(mounted)
        return ApiLock(key=read_mounted(path), source=path)
    path = generated(unit_dir(unit_of(server_args), env))
    try:
        return ApiLock(key=_read_own(path), source=path)
    except OSError as exc:
        raise ApiKeyError(f"{path}: {exc.strerror or exc}") from exc
