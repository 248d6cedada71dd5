"""Prefill attention (backend/model/prefill_attention.py): the padded causal form the opt-in cuDNN path runs,
against plain causal attention; its buckets; its switch. The cuDNN plans and the GPU choice need CUDA
and are skipped on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tandem.backend.model import prefill_attention as pa


def _qkv(t: int, heads: int, kv_heads: int, dtype: torch.dtype, device: str, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, 64, generator=g).to(dtype).to(device)
    k = torch.randn(t, kv_heads, 64, generator=g).to(dtype).to(device)
    v = torch.randn(t, kv_heads, 64, generator=g).to(dtype).to(device)
    return q, k, v


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kh, vh, is_causal=True)
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)


def test_buckets_round_up_to_whole_buckets() -> None:
    assert [pa.bucket(n) for n in (1, 256, 257, 1024, 1025, 2048, 2049)] == [
        256,
        256,
        512,
        1024,
        1280,
        2048,
        2304,
    ]


@pytest.mark.parametrize("expand", [False, True])
@pytest.mark.parametrize(("t", "length"), [(5, 5), (5, 16), (300, 512)])
def test_padding_changes_no_real_row(t: int, length: int, expand: bool) -> None:
    """Zero rows appended after a prompt are never attended by its rows (causal): same output."""
    q, k, v = _qkv(t, 8, 2, torch.float32, "cpu", seed=t)
    with sdpa_kernel([SDPBackend.MATH]):
        got = pa.padded_causal(q, k, v, length, expand)
        want = _plain(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_padded_length_shorter_than_the_prompt_is_refused() -> None:
    q, k, v = _qkv(10, 4, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="shorter than the prompt's 10 rows"):
        pa.padded_causal(q, k, v, 8)


def test_planning_is_a_no_op_on_the_cpu() -> None:
    assert pa.plan_cudnn(torch.device("cpu"), torch.float32, 8, 2, 64, 4096) == 0
    assert not pa._CUDNN_PLANNED


def test_flash_is_the_default() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_PREFILL_ATTENTION"}
    proc = subprocess.run(
        [sys.executable, "-c", "from tandem.backend.model import prefill_attention as p; print(p.USE_CUDNN)"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


def test_bad_switch_stops_the_import_naming_it() -> None:
    env = {**os.environ, "TANDEM_PREFILL_ATTENTION": "fast"}
    proc = subprocess.run(
        [sys.executable, "-c", "import tandem.backend.model.prefill_attention"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "TANDEM_PREFILL_ATTENTION must be flash or cudnn" in proc.stderr


@pytest.mark.gpu
def test_cudnn_runs_planned_buckets_only_and_matches_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the switch on: planned buckets (1,024..1,536 rows) go through cuDNN and give flash's output
    to bf16 rounding; a longer prompt (no plan) and a shorter one keep flash."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    monkeypatch.setattr(pa, "USE_CUDNN", True)
    monkeypatch.setattr(pa, "_CUDNN_PLANNED", {})
    dev = torch.device("cuda")
    planned = pa.plan_cudnn(dev, torch.bfloat16, 32, 8, 64, 1536)
    if planned == 0:
        pytest.skip("this torch/GPU has no cuDNN attention (the plan was refused; flash serves)")
    assert planned == 3
    assert sorted(key[-1] for key in pa._CUDNN_PLANNED) == [1024, 1280, 1536]
    for t in (1000, 1100, 1536, 1600):
        q, k, v = _qkv(t, 32, 8, torch.bfloat16, "cuda", seed=t)
        got = pa.attend_gpu(q, k, v, 0)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            monkeypatch.setattr(pa, "USE_CUDNN", False)
            want = pa.attend_gpu(q, k, v, 0)
            monkeypatch.setattr(pa, "USE_CUDNN", True)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
