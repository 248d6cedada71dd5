"""The voice store: atomic, no-clobber writes; a crash between write and publish leaves the old state;
readers see a registration, a deletion and a re-registration on their next lookup; names that could
leave the directory are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.backend.errors import AlreadyExists, InvalidInput, NotFound
from tandem.backend.voices.store import VoiceStore, check_name, default_dir, resolve_dir
from tests.support.voice_records import record


def test_add_get_list_remove(tmp_path: Path) -> None:
    writer, reader = VoiceStore(tmp_path / "v"), VoiceStore(tmp_path / "v")
    assert reader.get("ana") is None and reader.names() == []  # no directory yet: no voices
    writer.add(record("ana"))
    writer.add(record("bo_b-2"))
    assert reader.get("ana") == record("ana")
    assert reader.names() == ["ana", "bo_b-2"] and len(reader.records()) == 2
    with pytest.raises(AlreadyExists, match=r"\[ALREADY_EXISTS\] NAME 'ana' is already a registered voice"):
        writer.add(record("ana", transcript="another"))
    assert reader.get("ana") == record("ana")  # the refused write changed nothing
    writer.remove("ana")
    assert reader.get("ana") is None and reader.names() == ["bo_b-2"]
    with pytest.raises(NotFound, match=r"\[NOT_FOUND\] NAME 'ana' is not a registered voice"):
        writer.remove("ana")


def test_reader_sees_a_re_registration(tmp_path: Path) -> None:
    writer, reader = VoiceStore(tmp_path), VoiceStore(tmp_path)
    writer.add(record("ana", transcript="first", frames=2))
    assert reader.get("ana").transcript == "first"  # type: ignore[union-attr]
    writer.remove("ana")
    writer.add(record("ana", transcript="second one", frames=4))
    got = reader.get("ana")
    assert got is not None and got.transcript == "second one" and len(got.frames) == 4


def test_files_are_private_and_temporaries_gone(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path / "v")
    store.add(record("ana"))
    assert sorted(os.listdir(tmp_path / "v")) == ["ana.voice"]
    assert (tmp_path / "v" / "ana.voice").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "v").stat().st_mode & 0o777 == 0o700


class _CrashBeforePublish(VoiceStore):
    def _publish(self, tmp: Path, final: Path) -> None:
        assert tmp.is_file() and tmp.stat().st_size > 0  # written and fsynced, not yet visible
        raise OSError("injected crash between write and publish")


def test_a_failure_between_write_and_publish_leaves_the_old_state(tmp_path: Path) -> None:
    VoiceStore(tmp_path).add(record("ana"))
    with pytest.raises(OSError, match="injected"):
        _CrashBeforePublish(tmp_path).add(record("bob"))
    reader = VoiceStore(tmp_path)
    assert reader.names() == ["ana"] and reader.get("bob") is None
    assert sorted(os.listdir(tmp_path)) == ["ana.voice"]  # the writer removed its temporary file


def test_sweep_removes_a_dead_writers_temporaries_only(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    store.add(record("ana"))
    stale, fresh = tmp_path / ".bob.aaaa.tmp", tmp_path / ".cy.bbbb.tmp"
    stale.write_bytes(b"{half a rec")
    fresh.write_bytes(b"{being written")
    os.utime(stale, (1.0, 1.0))
    assert store.sweep() == 1
    assert sorted(os.listdir(tmp_path)) == [".cy.bbbb.tmp", "ana.voice"]
    assert store.names() == ["ana"]  # temporaries are never voices


def test_a_corrupt_file_reads_as_absent(tmp_path: Path) -> None:
    (tmp_path / "ana.voice").write_bytes(b'{"name": "ana"')
    assert VoiceStore(tmp_path).get("ana") is None


@pytest.mark.parametrize(
    "name", ["../x", "a/b", "", "x" * 65, "é", "a b", ".hidden", "a.b.c", "a..b", "acme.", ".x"]
)
def test_names_outside_the_pattern_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidInput, match=r"\[INVALID_ARG\] NAME .* is not a voice name"):
        check_name(name)
    store = VoiceStore(tmp_path)
    assert store.get(name) is None
    with pytest.raises(InvalidInput):
        store.add(record(name))
    assert os.listdir(tmp_path) == []


def test_directory_setting() -> None:
    env = {"HOME": "/home/u"}
    assert default_dir(env) == Path("/home/u/.local/state/tandem/voices")
    assert default_dir({**env, "XDG_STATE_HOME": "/var/state"}) == Path("/var/state/tandem/voices")
    assert resolve_dir("", env) == default_dir(env)
    assert resolve_dir("/srv/voices", env) == Path("/srv/voices")
    with pytest.raises(ValueError, match=r"voices\.dir.*absolute"):
        resolve_dir("relative/voices", env)
