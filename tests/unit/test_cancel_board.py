"""The unit's cancel board (serving/cancel_board.py): D's instances share one directory; a posting
is seen by the instance that holds the stream, used once, and swept after its ttl."""

from __future__ import annotations

import os
import time

import pytest

from tandem.serving import cancel_board
from tandem.serving.cancel_board import CancelBoard


def test_a_posting_is_seen_by_any_instance_and_used_once(tmp_path):
    posting, holder, other = (CancelBoard(tmp_path / "cancels") for _ in range(3))
    posting.post(42)
    assert not other.posted(41)  # another stream of another instance: untouched
    assert holder.posted(42)
    assert not holder.posted(42)  # used up: a later stream with the id runs
    time.sleep(cancel_board.READ_EVERY_S)
    assert not other.posted(42)  # gone from the directory too
    assert os.listdir(tmp_path / "cancels") == []


def test_a_posting_made_before_the_stream_arrives_waits_for_it(tmp_path):
    board = CancelBoard(tmp_path / "cancels")
    assert not board.posted(7)  # the listing is read now (empty) ...
    board.post(7)  # ... and a post makes the next question read it again
    assert board.posted(7)


def test_a_posting_nobody_uses_is_swept_after_its_ttl(tmp_path):
    board = CancelBoard(tmp_path / "cancels", ttl_s=0.2)
    board.post(9)
    old = time.time() - 1.0
    os.utime(tmp_path / "cancels" / "9", (old, old))
    assert not board.posted(9)
    assert os.listdir(tmp_path / "cancels") == []


@pytest.mark.parametrize("bad", [0, -1])
def test_a_non_positive_id_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="a stream id is a positive sequence_id"):
        CancelBoard(tmp_path / "cancels").post(bad)


def test_the_board_is_private_to_the_unit(tmp_path):
    CancelBoard(tmp_path / "cancels").post(3)
    assert (tmp_path / "cancels").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "cancels" / "3").stat().st_mode & 0o777 == 0o600


def test_a_full_board_refuses_more(tmp_path, monkeypatch):
    monkeypatch.setattr(cancel_board, "MAX_POSTINGS", 3)
    board = CancelBoard(tmp_path / "cancels")
    for sid in (1, 2, 3):
        board.post(sid)
    with pytest.raises(cancel_board.BoardFull, match="holds 3 postings"):
        board.post(4)
    assert board.posted(1)  # used: room again
    board.post(4)
