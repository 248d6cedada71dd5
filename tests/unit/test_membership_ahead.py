"""D's membership (`backend/engines/decode/admission.py`, `Membership`): what the admission
look-ahead is shown of the members (`view`) — admitted ones by their prompt and limit, joined ones by
their real context and rows generated — through reserve, join, the engine's snapshot and leave."""

from __future__ import annotations

import numpy as np
import torch

from tandem.backend.engines.decode.admission import Membership
from tandem.backend.engines.stream import Stream
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.kv.layout import KVLayout
from tandem.backend.kv.pool import KVPool
from tandem.backend.scheduling.decode_policy import AdmissionPlan
from tandem.backend.timing import Timings


class _Sink:
    def emit(self, chunk: object) -> None: ...

    def fail(self, error: object) -> None: ...

    def cancelled(self) -> bool:
        return False


def _stream(sid: int, prompt_len: int, max_new: int, pages: list[int]) -> Stream:
    return Stream(sid, prompt_len, SamplingParams(), max_new, _Sink(), Timings(), pages=pages)


def test_the_look_ahead_sees_each_member_by_its_real_state() -> None:
    members = Membership(KVPool(KVLayout(1, 1, 4, torch.float32), 64, 16, torch.device("cpu")))
    seen: list[tuple[int, int, list[list[int]]]] = []

    def reserve(capacity: int, prompt_len: int, max_new_rows: int) -> list[int]:
        """As D's admission does: the view and the reservation in one hold of the lock."""
        with members.lock:
            view = members.view()
            seen.append((view.count, view.context, [a.tolist() for a in view.ahead]))
            plan = AdmissionPlan(members.pool.pages_for(capacity), None)
            return members.reserve(plan, prompt_len, max_new_rows)

    a_pages = reserve(100 + 50, 100, 50)
    b_pages = reserve(30 + 200, 30, 200)
    looks = [reserve(10, 10, 0)]  # a third member, and what it was shown
    assert seen[0] == (0, 0, [[], [], []])
    assert sorted(zip(*seen[2][2], strict=True)) == [(30, 0, 200), (100, 0, 50)]  # admitted: prompt, limit
    a, b = _stream(1, 100, 50, a_pages), _stream(2, 30, 200, b_pages)
    members.join(a)
    a.generated = [np.zeros(1, dtype=np.int64)] * 7
    members.set_running(107, [a])  # the engine's snapshot: a has generated 7 rows
    looks.append(reserve(10, 10, 0))
    assert sorted(zip(*seen[-1][2], strict=True)) == [(10, 0, 0), (30, 0, 200), (107, 7, 50)]
    members.leave(b, joined=False)  # b never joined: it leaves the admitted ones
    members.set_running(0, [])  # a finished and left the batch
    members.leave(a, joined=True)
    for i, pages in enumerate(looks):
        members.leave(_stream(3 + i, 10, 0, pages), joined=False)
    reserve(10, 10, 0)
    assert seen[-1] == (0, 0, [[], [], []])
    assert members.pool.num_free_pages == 64 - 1  # all but the last newcomer's page came back
