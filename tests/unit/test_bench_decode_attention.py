"""`tandem-bench-decode-attention` on the CPU: its slot tables, and a clear refusal without CUDA."""

from __future__ import annotations

import pytest
import torch

from tandem.bench import decode_attention as bench_decode_attention


def test_slots_are_shuffled_whole_pages_without_overlap() -> None:
    gen = torch.Generator().manual_seed(0)
    slots = bench_decode_attention._slots(3, 40, 16, gen, torch.device("cpu"))
    assert slots.shape == (3, 40) and slots.is_contiguous()
    assert len(set(slots.reshape(-1).tolist())) == 120  # no slot shared between streams
    pages = slots[:, ::16] // 16
    assert torch.equal(slots, pages.repeat_interleave(16, dim=1)[:, :40] * 16 + torch.arange(40) % 16)
    one = bench_decode_attention._slots(2, 5, 1, gen, torch.device("cpu"))
    assert sorted(one.reshape(-1).tolist()) == list(range(10))


def test_refuses_without_cuda(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is the CPU's")
    assert bench_decode_attention.main(["--batches", "1", "--context", "16"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chunks", "128,-1"], "--chunks must be >= 0"),
    ],
)
def test_bad_options_are_refused_before_any_work(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_decode_attention.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
