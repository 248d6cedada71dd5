"""The decoder's fused Triton kernels (csrc/triton_ops.py) against their torch references.

The GPU grid needs CUDA and Triton and is skipped on the CPU; the CPU runs the references through the
same entry points (the fallback) and the argument checks.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tandem.backend.model.layers import rope_cos_sin
from tandem.backend.model.rope import inv_freq
from tandem.csrc import triton_ops

# One rounding of the dtype (the kernels round where torch rounds; only the norm's sum order differs).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _need_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if not triton_ops.available(torch.empty(1, device="cuda")):
        pytest.skip("Triton not importable")


def _randn(*shape: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _rope_case(
    n: int, nh: int, kvh: int, hd: int, dtype: torch.dtype, device: str, norm: bool, seed: int
) -> dict[str, object]:
    qkv = _randn(n, (nh + 2 * kvh) * hd, dtype=dtype, device=device, seed=seed)
    positions = torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed)).to(device)
    cos, sin = rope_cos_sin(inv_freq(hd, 1e6, None, torch.device(device)), positions, dtype)
    qn = (1 + 0.1 * _randn(hd, dtype=torch.float32, device=device, seed=seed + 1)).to(dtype) if norm else None
    kn = (1 + 0.1 * _randn(hd, dtype=torch.float32, device=device, seed=seed + 2)).to(dtype) if norm else None
    pool_rows = 4 * n + 7
    slots = torch.randperm(pool_rows, generator=torch.Generator().manual_seed(seed))[:n].to(device)
    return {"qkv": qkv, "cos": cos, "sin": sin, "q_norm": qn, "k_norm": kn, "slots": slots, "rows": pool_rows}


def _rope_both(
    case: dict[str, object], nh: int, kvh: int, hd: int, dtype: torch.dtype, device: str, rows: int = 1
) -> tuple:
    outs = []
    for fn in (partial(triton_ops.rope_kv_write, rows_per_program=rows), triton_ops.reference_rope_kv_write):
        kv = torch.full((2, int(case["rows"]), kvh, hd), float("nan"), dtype=dtype, device=device)  # type: ignore[call-overload]
        q = fn(
            case["qkv"], case["cos"], case["sin"], case["q_norm"], case["k_norm"], 1e-6, kv, case["slots"], nh
        )  # type: ignore[arg-type]
        outs.append((q, kv))
    return outs[0], outs[1]


# ---- GPU grid ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 896, 2560, 3072])
@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference(dtype: torch.dtype, hidden: int, n: int, with_residual: bool) -> None:
    _need_gpu()
    a = _randn(n, hidden, dtype=dtype, device="cuda", seed=n + hidden)
    r = _randn(n, hidden, dtype=dtype, device="cuda", seed=n + hidden + 1) if with_residual else None
    w = (1 + 0.1 * _randn(hidden, dtype=torch.float32, device="cuda", seed=3)).to(dtype)
    got, got_res = triton_ops.add_rms_norm(a, r, w, 1e-6)
    want, want_res = triton_ops.reference_add_rms_norm(a, r, w, 1e-6)
    assert got.dtype == dtype and got.shape == a.shape
    assert torch.equal(got_res, want_res)  # the residual add is one rounding in both
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("nh", "kvh", "hd"), [(32, 8, 128), (24, 8, 128), (14, 2, 64), (4, 2, 16)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize(("n", "rows"), [(1, 1), (64, 1), (1, 16), (37, 16), (64, 16)])
def test_rope_kv_write_matches_reference(
    dtype: torch.dtype, nh: int, kvh: int, hd: int, norm: bool, n: int, rows: int
) -> None:
    """q, and every K and V row written at its (shuffled) slot; rows of other slots stay untouched. With
    16 rows a program (prefill's), the last program's rows past n are masked."""
    _need_gpu()
    case = _rope_case(n, nh, kvh, hd, dtype, "cuda", norm, seed=nh + hd + n)
    (q, kv), (q_ref, kv_ref) = _rope_both(case, nh, kvh, hd, dtype, "cuda", rows)
    torch.testing.assert_close(q.float(), q_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    slots = case["slots"]
    assert isinstance(slots, torch.Tensor)
    torch.testing.assert_close(
        kv[:, slots].float(), kv_ref[:, slots].float(), atol=TOL[dtype], rtol=TOL[dtype]
    )
    assert torch.equal(kv[1, slots], kv_ref[1, slots])  # V is copied, bit for bit
    others = torch.ones(kv.shape[1], dtype=torch.bool, device="cuda")
    others[slots] = False
    assert kv[:, others].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [128, 4864, 8192, 9728])
@pytest.mark.parametrize("n", [1, 33])
def test_swiglu_matches_reference(dtype: torch.dtype, inter: int, n: int) -> None:
    _need_gpu()
    gu = _randn(n, 2 * inter, dtype=dtype, device="cuda", seed=inter + n)
    got, want = triton_ops.swiglu(gu), triton_ops.reference_swiglu(gu)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
def test_kernels_are_graph_capturable() -> None:
    """Captured once, a replay reads the inputs' new values (nothing was baked in at capture)."""
    _need_gpu()
    a = _randn(8, 2560, dtype=torch.bfloat16, device="cuda", seed=1)
    r = _randn(8, 2560, dtype=torch.bfloat16, device="cuda", seed=2)
    w = torch.ones(2560, dtype=torch.bfloat16, device="cuda")
    gu = _randn(8, 2 * 512, dtype=torch.bfloat16, device="cuda", seed=3)
    triton_ops.add_rms_norm(a, r, w, 1e-6), triton_ops.swiglu(gu)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (out, res), act = triton_ops.add_rms_norm(a, r, w, 1e-6), triton_ops.swiglu(gu)
    a.copy_(_randn(8, 2560, dtype=torch.bfloat16, device="cuda", seed=4))
    gu.copy_(_randn(8, 2 * 512, dtype=torch.bfloat16, device="cuda", seed=5))
    graph.replay()
    torch.cuda.synchronize()
    want, want_res = triton_ops.reference_add_rms_norm(a, r, w, 1e-6)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(act.float(), triton_ops.reference_swiglu(gu).float(), atol=1.6e-2, rtol=1.6e-2)


# ---- everywhere ----------------------------------------------------------------------------------------


def test_cpu_runs_the_references() -> None:
    a, r = (
        _randn(3, 32, dtype=torch.float32, device="cpu", seed=1),
        _randn(3, 32, dtype=torch.float32, device="cpu", seed=2),
    )
    w = torch.rand(32) + 0.5
    assert not triton_ops.available(a)
    got, want = triton_ops.add_rms_norm(a, r, w, 1e-6), triton_ops.reference_add_rms_norm(a, r, w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    gu = _randn(2, 64, dtype=torch.float32, device="cpu", seed=3)
    assert torch.equal(triton_ops.swiglu(gu), triton_ops.reference_swiglu(gu))
    case = _rope_case(5, 4, 2, 16, torch.float32, "cpu", True, seed=4)
    (q, kv), (q_ref, kv_ref) = _rope_both(case, 4, 2, 16, torch.float32, "cpu")
    assert torch.equal(q, q_ref) and torch.equal(kv.nan_to_num(7.0), kv_ref.nan_to_num(7.0))


def test_reference_rope_is_the_layers_rope() -> None:
    """The reference is `Attention.qkv`'s maths: qk-norm then RoPE with rotate_half."""
    from tandem.backend.model.layers import RMSNorm, apply_rope

    case = _rope_case(6, 4, 2, 16, torch.float32, "cpu", True, seed=5)
    qkv, cos, sin = case["qkv"], case["cos"], case["sin"]
    assert isinstance(qkv, torch.Tensor) and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
    (q, _), _ = _rope_both(case, 4, 2, 16, torch.float32, "cpu")
    qn = RMSNorm(16, 1e-6, torch.float32)
    qn.weight.data.copy_(case["q_norm"])  # type: ignore[arg-type]
    want = apply_rope(qn(qkv[:, : 4 * 16].reshape(6, 4, 16)), cos, sin)
    torch.testing.assert_close(q, want, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: triton_ops.add_rms_norm(torch.zeros(2, 8), None, torch.ones(4), 1e-6), "do not fit"),
        (lambda: triton_ops.swiglu(torch.zeros(2, 7)), r"\[N, 2I\]"),
        (
            lambda: triton_ops.rope_kv_write(
                torch.zeros(2, 64), torch.zeros(2, 16), torch.zeros(2, 16), None, None, 1e-6,
                torch.zeros(2, 8, 2, 16), torch.zeros(2, dtype=torch.long), 4,
            ),
            "do not fit",
        ),
        (
            lambda: triton_ops.rope_kv_write(
                torch.zeros(2, 128), torch.zeros(2, 16), torch.zeros(2, 16), None, None, 1e-6,
                torch.zeros(8, 2, 16), torch.zeros(2, dtype=torch.long), 4,
            ),
            r"kv must be \[2, S, kvh, hd\]",
        ),
    ],
)  # fmt: skip
def test_bad_shapes_raise_clear_errors(call, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        call()
