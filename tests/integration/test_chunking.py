"""Chunk sizes follow the listener's lead, through the real tritonserver (`tts` and `tts_mono`).

The checked-in repository: the reference codec at 21 rows/s, the first chunk 4 rows, then the
largest rung of 1, 2, 4, 8, 16, 32 rows whose audio is at most half of what a real-time listener
has buffered (backend/codec/chunking.py). The client here is that listener: it plays each response's
audio from the first on and measures its own lead. D chose each size from its lead when the chunk
before left; the client's lead differs from it only by how much longer that chunk took to arrive
than the first (the vocoder's and the network's delays), so the checks allow `SLACK_S` of that.
"""

from __future__ import annotations

import pytest

from tests.support.helpers import SPR, prompt, run

RT = 21.0  # rows per second of audio
LADDER = (1, 2, 4, 8, 16, 32)
ROWS = 600  # 28.6 s of audio: seconds of lead build up even at 1.5x real time
SLACK_S = 1.0


@pytest.mark.parametrize("model", ["tts", "tts_mono"])
def test_chunk_sizes_grow_with_the_listeners_lead(server, model: str) -> None:
    r = run(server.url, model, prompt(30, seed=7), MAX_TOKENS=ROWS, timeout_s=300)
    assert r.error is None and r.rows is not None and r.rows.shape[0] == ROWS
    sizes = r.response_rows
    assert sum(sizes) == ROWS and sum(r.response_samples) == ROWS * SPR  # every row sounds
    assert sizes[0] == 4  # first audio as early as ever
    assert sizes[1] == 2  # the first chunk's 4 rows buffered allow a chunk of half that
    assert set(sizes[:-1]) <= set(LADDER)
    assert r.playback_stalls(SPR * int(RT)) == (0, 0.0)

    # the client's lead after each response, before the next one
    t0 = r.response_ns[0] / 1e9
    heard, leads = 0, []
    for at_ns, rows in zip(r.response_ns, sizes, strict=True):
        heard += rows
        leads.append(heard / RT - (at_ns / 1e9 - t0))
    long = 0
    for k in range(1, len(sizes) - 1):  # non-final chunks chosen after a sounding one
        size, lead = sizes[k], leads[k - 1]
        assert size / RT <= max(1 / RT, 0.5 * (lead + SLACK_S)) + 1e-9, (k, size, lead)
        if lead - SLACK_S >= 2 * 32 / RT:  # seconds buffered: the largest chunks
            assert size == 32, (k, size, lead)
            long += 1
    assert long > 0, f"the lead never reached {2 * 32 / RT + SLACK_S:.1f} s: {leads[-2]:.2f} s at the end"
