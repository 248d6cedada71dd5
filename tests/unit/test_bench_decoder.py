"""`tandem-bench-decoder` on the CPU (tiny preset, a few steps): the result file, and the prefill
first-call probe (`--distinct-lengths`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench import decoder as bench_decoder

SMALL = ["--preset", "tiny", "--device", "cpu", "--prompts", "64,128", "--batches", "1,2", "--context", "32"]
SMALL += ["--steps", "2", "--warmup", "1", "--prefill-reps", "1", "--prefill-warmup", "1"]


def test_distinct_lengths_are_new_unique_and_span_the_range() -> None:
    zero, prefixed = bench_decoder.distinct_lengths(5, 100, 200, {100, 150})
    both = zero + prefixed
    assert len(zero) == len(prefixed) == 5
    assert len(set(both)) == 10 and not {100, 150} & set(both)
    assert all(100 <= x <= 200 for x in both)
    assert min(both) == 101 and max(both) == 200
    assert bench_decoder.distinct_lengths(1, 7, 8, set()) == ([7], [8])
    with pytest.raises(ValueError, match="unused lengths"):
        bench_decoder.distinct_lengths(3, 10, 14, {12})


def test_cpu_run_with_the_first_call_probe(tmp_path, capsys) -> None:
    argv = [*SMALL, "--distinct-lengths", "3", "--distinct-range", "60,140", "--out", str(tmp_path)]
    argv += ["--name", "r"]
    assert bench_decoder.main(argv) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert [p["prompt_rows"] for p in result["prefill"]] == [64, 128]
    assert len(result["decode"]) == 2
    sdpa = result["meta"]["sdpa_enabled"]
    assert "math" in sdpa and all(isinstance(v, bool) for v in sdpa.values())
    prefill_backends = result["meta"]["sdpa_prefill_backends"]
    assert prefill_backends is None or all(isinstance(b, str) for b in prefill_backends)
    first = result["prefill_first_call"]
    assert first["range"] == [60, 140]
    samples = first["samples"]
    zero = [s for s in samples if s["path"] == "position0"]
    prefixed = [s for s in samples if s["path"] == "prefixed"]
    assert len(zero) == len(prefixed) == 3
    assert all(s["start"] == 0 and s["total"] == s["rows"] for s in zero)
    # the masked path: a page-aligned cached prefix (page size 16), never the whole prompt
    assert all(0 < s["start"] < s["total"] and s["start"] % 16 == 0 for s in prefixed)
    totals = [s["total"] for s in samples]
    assert len(set(totals)) == 6 and not {64, 128} & set(totals)  # each length new to the process
    for path in ("position0", "prefixed"):
        q = first[path]
        ms = sorted(s["ms"] for s in samples if s["path"] == path)
        assert q["n"] == 3 and q["max_ms"] == ms[-1] and q["p50_ms"] == ms[1]
        assert all(v > 0 for v in ms)
    out = capsys.readouterr().out
    assert "prefill first call at position 0: 3 new lengths in [60, 140]" in out
    assert "prefill first call after a cached prefix: 3 new lengths" in out


def test_plot_prefill_draws_labelled_results_and_refuses_unlabelled_ones(tmp_path) -> None:
    """The H200 prefill JSONs checked in (docs/benchmarks) redraw side by side; a JSON with no label
    is a usage error (exit 2)."""
    docs = Path(__file__).parents[2] / "docs" / "benchmarks"
    png = tmp_path / "p.png"
    argv = ["--plot-prefill", str(png), f"before={docs / 'prefill-qwen3-4b-shape-h200-before.json.gz'}"]
    argv.append(f"after={docs / 'prefill-qwen3-4b-shape-h200.json.gz'}")
    assert bench_decoder.main(argv) == 0
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit) as exc:
        bench_decoder.main(["--plot-prefill", str(png), str(docs / "prefill-qwen3-4b-shape-h200.json.gz")])
    assert exc.value.code == 2


def test_probe_is_off_by_default_and_checks_its_range(tmp_path) -> None:
    assert bench_decoder.main([*SMALL, "--out", str(tmp_path), "--name", "r"]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert "prefill_first_call" not in result and "sdpa_enabled" in result["meta"]
    with pytest.raises(SystemExit):
        bench_decoder.main([*SMALL, "--distinct-lengths", "5", "--distinct-range", "60,65"])


def test_roofline_bytes_model() -> None:
    """Weights once (the tied table once, as the head; an untied table not at all) plus every stream's KV."""
    from dataclasses import replace

    from tandem.backend.model.config import preset
    from tandem.backend.model.decoder import Decoder
    from tandem.bench import roofline as decoder_roofline

    tied = Decoder(replace(preset("tiny"), tie_word_embeddings=True))
    untied = Decoder(replace(preset("tiny"), tie_word_embeddings=False))
    params = sum(p.numel() * p.element_size() for p in tied.parameters())
    assert decoder_roofline.weight_bytes(tied) == params
    emb = untied.model.embed_tokens.weight
    untied_params = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert decoder_roofline.weight_bytes(untied) == untied_params - emb.numel() * emb.element_size()
    b = decoder_roofline.step_bytes(tied, 3, 100)
    kv = tied.cfg.kv_bytes_per_token
    assert b == {"weights": params, "kv_read": 300 * kv, "kv_written": 3 * kv, "total": params + 303 * kv}
    r = decoder_roofline.roofline(tied, 3, 100, step_ms=2.0, hbm_tb_s=4.8)
    assert r["roofline_ms"] == b["total"] / 4.8e12 * 1e3 and r["fraction"] * 2.0 == r["roofline_ms"]
    # the 4B shape's step at 64 x 2048 reads 8.0 GB of weights and 19.3 GB of KV
    assert preset("qwen3-4b-shape").kv_bytes_per_token * 64 * 2048 == 19_327_352_832


def test_prefill_flop_model_counts_the_linear_weights_the_causal_triangle_and_the_last_rows_head() -> None:
    from tandem.backend.model.config import PRESETS
    from tandem.backend.model.decoder import Decoder
    from tandem.bench import roofline as decoder_roofline

    dec = Decoder.random(PRESETS["tiny"])
    # tiny: hidden 64, 4 heads and 2 KV heads of 16, intermediate 128, 2 layers, vocab 1024, 4 columns.
    # Per layer the q, k, v, o weights hold 64 x 16 x (4 + 2 + 2) + 4 x 16 x 64 and the MLP 3 x 64 x 128.
    linear = [dec.model.layers[0].self_attn, dec.model.layers[0].mlp]
    per_layer = sum(
        p.numel() for m in linear for n, p in m.named_parameters() if n.endswith("weight") and p.ndim == 2
    )
    assert per_layer == 64 * 16 * 8 + 64 * 64 + 3 * 64 * 128
    f = decoder_roofline.prefill_flops(dec, 10)
    assert f["linear"] == 2 * 10 * per_layer * 2
    assert f["attention"] == 2 * 2 * 10 * 10 / 2 * 4 * 16 * 2
    assert f["head"] == 2 * 64 * 1024 * 4
    r = decoder_roofline.prefill_roofline(dec, 10, ms=1.0, peak_tflops=1.0)
    assert r["bound_ms"] == f["total"] / 1e12 * 1e3 and r["tc_fraction"] == r["bound_ms"]


def test_kernel_families_by_name() -> None:
    from tandem.bench import roofline as decoder_roofline

    assert decoder_roofline.family("void tandem::decode_partial_staged<...>") == "attention"
    assert decoder_roofline.family("_rope_kv_write_kernel") == "fused norm/rope/swiglu (triton)"
    assert decoder_roofline.family("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert decoder_roofline.family("nvjet_tst_64x8_64x16") == "gemm"
    assert decoder_roofline.family("void pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert decoder_roofline.family("vectorized_elementwise_kernel<4, ...>") == "other elementwise"


def test_forward_only_needs_cuda(tmp_path) -> None:
    with pytest.raises(SystemExit):
        bench_decoder.main([*SMALL, "--forward-only", "--out", str(tmp_path)])
