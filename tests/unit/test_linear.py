"""The decoder's linear layers (csrc/linear.py): the small-batch CUDA GEMV (csrc/gemv.cu) against
F.linear, and the fallback everywhere else.

The GPU cases need CUDA and the built module and are skipped on the CPU; the fallback, the setting's
validation and the decoder's use of it run everywhere.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tandem.backend.model.config import PRESETS
from tandem.backend.model.decoder import Decoder
from tandem.csrc import kv_cuda
from tandem.csrc import linear as lin


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if kv_cuda.module() is None:
        pytest.skip(kv_cuda.build_info())


@pytest.mark.parametrize("shape", [(3, 40), (2, 5, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_is_f_linear(shape: tuple[int, ...], bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(24, 40, generator=g)
    b = torch.randn(24, generator=g) if bias else None
    assert not lin.gemv_runs(x.reshape(-1, 40), w, b)
    assert torch.equal(lin.linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("value", ["9", "-1", "four"])
def test_bad_setting_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("TANDEM_GEMV_ROWS", value)
    with pytest.raises(ValueError, match="TANDEM_GEMV_ROWS must be"):
        lin._max_rows()


def test_setting_is_read_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GEMV_ROWS", "0")
    try:
        assert importlib.reload(lin).GEMV_MAX_ROWS == 0
    finally:
        monkeypatch.delenv("TANDEM_GEMV_ROWS")
        importlib.reload(lin)


# ---- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 2560), (2561, 4096), (19456, 2560), (2560, 9728), (7, 8), (33, 264)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(dtype: torch.dtype, rows: int, n: int, k: int, bias: bool) -> None:
    """Odd N (a warp's rows past the end), K not a multiple of a warp's 256 elements, tiny shapes."""
    _need_cuda()
    g = torch.Generator(device="cuda").manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None
    assert lin.gemv_runs(x, w, b, max_rows=8)
    got = lin.linear(x, w, b, max_rows=8)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_gemv_falls_back_where_it_cannot_run() -> None:
    """More rows than the limit (or the kernel's 8), float32, K not a multiple of 8, a strided or empty
    weight: F.linear runs."""
    _need_cuda()
    w = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)
    assert not lin.gemv_runs(x, w, max_rows=2)
    assert not lin.gemv_runs(x.float(), w.float(), max_rows=8)
    assert not lin.gemv_runs(x[:, :30], w[:, :30], max_rows=8)
    assert not lin.gemv_runs(x, w[::2], max_rows=8)
    assert not lin.gemv_runs(torch.randn(9, 32, device="cuda", dtype=torch.bfloat16), w, max_rows=16)
    assert not lin.gemv_runs(x, w[:0], max_rows=8)  # N = 0: F.linear's empty result
    tracked = w.clone().requires_grad_()
    assert not lin.gemv_runs(x, tracked, max_rows=8)  # no backward in the kernel
    with torch.no_grad():
        assert lin.gemv_runs(x, tracked, max_rows=8)
    torch.testing.assert_close(lin.linear(x, w[::2], max_rows=8), F.linear(x, w[::2]))


@pytest.mark.gpu
def test_gemv_is_graph_capturable() -> None:
    _need_cuda()
    w = torch.randn(4096, 2560, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(2, 2560, device="cuda", dtype=torch.bfloat16)
    lin.linear(x, w, max_rows=8)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin.linear(x, w, max_rows=8)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, lin.linear(x, w, max_rows=8))


@pytest.mark.gpu
def test_decoder_logits_same_with_the_gemv_and_with_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused bf16 forward of 3 rows through the GEMV gives cuBLAS's logits to bf16 rounding."""
    _need_cuda()
    cfg = replace(
        PRESETS["tiny"], num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=256, dtype="bfloat16"
    )
    dec = Decoder.random(cfg, device="cuda", seed=4)
    rows = torch.randint(0, cfg.vocab_size, (3, cfg.row_width), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(lin, "GEMV_MAX_ROWS", 0)
    want = dec.forward(rows)
    monkeypatch.setattr(lin, "GEMV_MAX_ROWS", 8)
    h = torch.empty(3, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert lin.gemv_runs(h, dec.model.layers[0].mlp.gate_up_weight())  # the path under test runs
    got = dec.forward(rows)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
