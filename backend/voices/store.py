"""The voice store: registered voices as one file each in a directory every model of the unit reads.

A voice is its name, its transcript and the reference recording's codec frames (the codec's own
encoding, `backend/voices/registrar.py`); the prompt prefix the family's cloning template makes of
them is built by the reader (`backend/text/cloning.py`), so the store holds no tokenizer's ids.

Layout: `<dir>/<name>.voice`, a JSON document (`VoiceRecord`, msgspec). Names are
`[A-Za-z0-9_-]{1,64}`, optionally in a namespace, `SPACE.NAME` with SPACE of the same characters
(`check_name`): the gateway keeps each tenant's voices under the tenant's name, `acme.bob`
(`gateway/tenants.py`). No part is empty or holds a dot, so a name never leaves the directory
(`../x` is refused) and never starts with the dot of a temporary file.

Writes are atomic and crash-safe (`add`): the record goes to a temporary file in the same directory
(`.<name>.<random>.tmp`, O_EXCL), which is fsynced, then hard-linked to its final name and unlinked,
and the directory is fsynced. `link` fails when the name exists, so two registrations of one name
cannot both win, whoever writes them. A crash before the link leaves the old state (the temporary
file is swept by the next writer, `sweep`); after it, the new one. `remove` unlinks and fsyncs the
directory.

Readers (the `frontend` step and `tts_mono` on every request naming a voice; `voices` listing) see
a new registration at once: `get` stats `<name>.voice` each time and re-reads the file when its
identity (inode, size, mtime, ctime in ns) changed since the cached read, so a deleted voice is
refused by the next request and a re-registered one is read anew. A stat costs ~2 us, a re-read
~0.1 ms. (A delete and a re-registration of the same name that land in one clock tick with a reused
inode and equal size would look unchanged; a registration takes at least the encoder's run after
the delete, far longer than a tick.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import msgspec

from tandem.backend.errors import AlreadyExists, InvalidInput, NotFound

log = logging.getLogger("tandem")

NAME_PATTERN = re.compile(r"(?:[A-Za-z0-9_-]{1,64}\.)?[A-Za-z0-9_-]{1,64}")
SUFFIX = ".voice"
_TMP = ".tmp"
SWEEP_AGE_S = 3600.0  # temporary files older than this are a crashed writer's


class VoiceRecord(msgspec.Struct, frozen=True):
    """One registered voice. `frames`: the reference's codec frames [F][K] in the codec's canonical
    order; `codec`, `sample_rate`, `samples_per_frame`: the codec that made them (a model whose codec
    differs cannot speak with them); `duration_s` and `source_rate`: the recording as uploaded."""

    name: str
    transcript: str
    frames: list[list[int]]
    codec: str
    sample_rate: int
    samples_per_frame: int
    duration_s: float
    source_rate: int
    created: float
    version: int = 1

    @property
    def frame_width(self) -> int:
        return len(self.frames[0]) if self.frames else 0

    def summary(self, builtin: bool = False) -> dict[str, object]:
        """What a listing shows of it (no codes)."""
        return {
            "id": self.name,
            "builtin": builtin,
            "transcript": self.transcript,
            "duration_s": round(self.duration_s, 3),
            "frames": len(self.frames),
            "codes": len(self.frames) * self.frame_width,
            "codec": self.codec,
            "created": self.created,
        }


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(VoiceRecord)


def check_name(name: str, field: str = "NAME") -> str:
    """`name` if it is a voice name; InvalidInput naming `field` otherwise."""
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidInput(
            f"{field} {name[:80]!r} is not a voice name: 1-64 of A-Z, a-z, 0-9, '_' and '-'"
            " (in a namespace: SPACE.NAME)"
        )
    return name


STATE_DIR_ENV = "TANDEM_STATE_DIR"  # the unit's state directory, set by tandem-unit (--state-dir)


def _xdg_state(environ: Mapping[str, str]) -> Path:
    state = environ.get("XDG_STATE_HOME") or os.path.join(environ.get("HOME") or "~", ".local", "state")
    return Path(os.path.expanduser(state))


def default_state_dir(unit: str, environ: Mapping[str, str]) -> Path:
    """`tandem-unit`'s state directory without `--state-dir`: `$XDG_STATE_HOME/tandem/units/<unit>`
    (else `~/.local/state/...`), one per unit name."""
    return _xdg_state(environ) / "tandem" / "units" / unit


def default_dir(environ: Mapping[str, str]) -> Path:
    """Where voices live when `tandem.voices.dir` is "": the unit's state directory's `voices`
    (`$TANDEM_STATE_DIR/voices`, which tandem-unit sets); a tritonserver started without tandem-unit
    and without that variable falls back to `$XDG_STATE_HOME/tandem/voices`, one per OS user."""
    unit = environ.get(STATE_DIR_ENV)
    if unit:
        return Path(os.path.expanduser(unit)) / "voices"
    return _xdg_state(environ) / "tandem" / "voices"


def resolve_dir(setting: str, environ: Mapping[str, str]) -> Path:
    """The store's directory from `tandem.voices.dir` (absolute, or "" for `default_dir`)."""
    if not setting:
        return default_dir(environ)
    path = Path(os.path.expanduser(setting))
    if not path.is_absolute():
        raise ValueError(
            f"parameter 'voices.dir': {setting!r} must be an absolute path (or '' for the default)"
        )
    return path


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class VoiceStore:
    """One directory of voices. Thread-safe; any number of processes may read and write it."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[int, int, int, int], VoiceRecord]] = {}

    def path(self, name: str) -> Path:
        return self.dir / f"{check_name(name)}{SUFFIX}"

    # ---- reading ---------------------------------------------------------------------------------

    def get(self, name: str) -> VoiceRecord | None:
        """The voice `name` as stored now, or None when there is none (or the name is no voice name).
        A file that does not decode is logged and reads as absent."""
        if not NAME_PATTERN.fullmatch(name):
            return None
        file = self.dir / f"{name}{SUFFIX}"
        try:
            ident = _identity(file.stat())
        except FileNotFoundError:
            with self._lock:
                self._cache.pop(name, None)
            return None
        with self._lock:
            hit = self._cache.get(name)
        if hit is not None and hit[0] == ident:
            return hit[1]
        try:
            record = _decoder.decode(file.read_bytes())
        except FileNotFoundError:  # removed between the stat and the read
            return None
        except (OSError, msgspec.DecodeError) as exc:
            log.error("voice store %s: cannot read %s: %s", self.dir, file.name, exc)
            return None
        with self._lock:
            self._cache[name] = (ident, record)
        return record

    def names(self) -> list[str]:
        """Registered names, sorted (an absent directory holds none)."""
        try:
            entries = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        out = [e[: -len(SUFFIX)] for e in entries if e.endswith(SUFFIX) and not e.startswith(".")]
        return sorted(n for n in out if NAME_PATTERN.fullmatch(n))

    def records(self) -> list[VoiceRecord]:
        return [r for r in (self.get(n) for n in self.names()) if r is not None]

    # ---- writing ---------------------------------------------------------------------------------

    def add(self, record: VoiceRecord) -> None:
        """Store `record` under its name, atomically; AlreadyExists (nothing changed) when the name
        is taken. Raises OSError when the directory cannot be written."""
        final = self.path(record.name)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.dir / f".{record.name}.{secrets.token_hex(6)}{_TMP}"
        data = _encoder.encode(record)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            self._publish(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._sync_dir()

    def _publish(self, tmp: Path, final: Path) -> None:
        """The one step that makes a written record visible: a hard link, which refuses an existing
        name (os.replace would overwrite it). Tests inject a crash here."""
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise AlreadyExists(f"NAME {final.stem!r} is already a registered voice") from None

    def remove(self, name: str) -> None:
        """Delete voice `name`; NotFound when there is none."""
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            raise NotFound(f"NAME {name!r} is not a registered voice") from None
        with self._lock:
            self._cache.pop(name, None)
        self._sync_dir()

    def sweep(self, older_than_s: float = SWEEP_AGE_S) -> int:
        """Remove temporary files a crashed writer left (older than `older_than_s`, so a writer
        running now keeps its own); returns how many. Called by the writer at start-up."""
        removed, now = 0, time.time()
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return 0
        for e in entries:
            if e.name.startswith(".") and e.name.endswith(_TMP):
                with contextlib.suppress(FileNotFoundError):
                    if now - e.stat().st_mtime >= older_than_s:
                        os.unlink(e.path)
                        removed += 1
        return removed

    def _sync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
