"""`tandem-bench-linear` on the CPU: the GEMM shapes it times for each preset, and clear refusals."""

from __future__ import annotations

import pytest
import torch

from tandem.backend.model.config import PRESETS
from tandem.backend.model.decoder import Decoder
from tandem.bench import linear as bench_linear


def test_shapes_are_the_decoders_weights() -> None:
    """Every (N, K) is the shape of a weight the fused decode step multiplies by (the tiny preset)."""
    dec = Decoder.random(PRESETS["tiny"], seed=0)
    layer = dec.model.layers[0]
    head = dec.model.embed_tokens.weight if dec.lm_head is None else dec.lm_head.weight
    weights = {
        "qkv": layer.self_attn.qkv_weight()[0],
        "o_proj": layer.self_attn.o_proj.weight,
        "gate_up": layer.mlp.gate_up_weight(),
        "down": layer.mlp.down_proj.weight,
        "head": head,
    }
    got = {name: (n, k) for name, n, k in bench_linear.shapes(dec.cfg)}
    assert got == {name: tuple(w.shape) for name, w in weights.items()}


def test_orpheus_shape_has_the_issue_sizes() -> None:
    got = {name: (n, k) for name, n, k in bench_linear.shapes(PRESETS["orpheus-3b-shape"])}
    assert got["qkv"] == ((24 + 2 * 8) * 128, 3072)
    assert got["gate_up"] == (2 * 8192, 3072)
    assert got["head"] == (156_940, 3072)


def test_unknown_backend_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_linear.main(["--backends", "cublas,magic"])
    assert exc.value.code == 2
    assert "unknown backends ['magic']" in capsys.readouterr().err


def test_refuses_without_cuda(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is the CPU's")
    assert bench_linear.main(["--rows", "1"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
