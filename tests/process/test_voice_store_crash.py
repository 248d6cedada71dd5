"""A writer killed (SIGKILL) in the middle of a registration leaves the store as it was: the record
is written and fsynced but not yet published when the kill lands; the next writer sweeps the
leftover temporary file, and the name can be registered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tandem.backend.voices.store import VoiceStore
from tests.support.voice_records import record

WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tandem.backend.voices.store import VoiceStore
    from tests.support.voice_records import record

    class Slow(VoiceStore):
        def _publish(self, tmp, final):
            print("written", flush=True)  # the temporary file is complete and fsynced
            time.sleep(60)  # killed here, before the link that would publish it
            super()._publish(tmp, final)

    Slow(Path(sys.argv[1])).add(record("bob", frames=400))
    """
)


def test_a_writer_killed_mid_registration_leaves_the_old_state(tmp_path: Path) -> None:
    VoiceStore(tmp_path).add(record("ana"))
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=repo
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "written"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert len(leftovers) == 1  # the dead writer's, complete but never published
    store = VoiceStore(tmp_path)
    assert store.names() == ["ana"] and store.get("bob") is None
    assert store.sweep(older_than_s=0.0) == 1 and sorted(os.listdir(tmp_path)) == ["ana.voice"]
    store.add(record("bob"))
    assert store.names() == ["ana", "bob"]
