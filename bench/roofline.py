"""The decode step's memory roofline and a kernel-family breakdown of one step (for `tandem-bench-decoder`).

Bytes model of one decode step of B streams at context C (what must cross HBM at least once):
- every weight once: all parameters except the input embedding table, whose step reads only B rows
  (with `--dtype fp8`, each projection's E4M3 bytes and its float32 scales);
  with tied embeddings the table is the output head and is counted once, as the head;
- every stream's KV for its context, read once: B x C x `kv_bytes_per_token` (K and V of every layer,
  one byte an element with `--kv-dtype fp8`);
- the new rows' KV written: B x `kv_bytes_per_token` (small).
Activations, logits and the split-K partials are left out (a few MB). Roofline time = bytes / the
bandwidth (4.8 TB/s, the H200 datasheet's, unless `--hbm-tb-s` says otherwise); fraction = roofline
time / measured step time (1.0 would be a step that only streams its bytes at the datasheet rate).

`bench_forward` times the forward alone (no sampling; the rows stay fixed, the positions advance): the
whole `decode` call (host staging of the inputs included) and, with CUDA graphs, the graph's replay
alone, which is the device step the roofline is compared with.

FLOP model of one prefill of T rows from position 0 (what the tensor cores must do at least once):
2 x T x every layer's linear weights (q, k, v, o, gate, up, down), causal attention 2 x 2 x T^2 / 2 x
heads x head_dim per layer (scores and P.V over the lower triangle), the output head for the last
row only (2 x hidden x vocab x W); norms, RoPE and the KV write are left out. Tensor-core fraction =
that FLOP count / time / the bf16 dense peak (989 TFLOP/s, the H100/H200 datasheet's, unless
`--tc-peak-tflops` says otherwise).

The breakdown runs one eager forward step (no CUDA graph, so every launch is visible) under the torch
profiler and sums device time and launches per kernel family, classified by the kernel's name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from tandem.backend.kv.pool import KVPool
from tandem.backend.model.cuda_graphs import GraphedDecode
from tandem.backend.model.decoder import Decoder
from tandem.bench import util as benchutil

H200_HBM_TB_S = 4.8
H200_BF16_DENSE_TFLOPS = 989.0

# (family, substrings of the kernel name), first match wins; anything else is "other elementwise".
FAMILIES: list[tuple[str, tuple[str, ...]]] = [
    ("attention", ("decode_partial", "decode_merge", "flash", "fmha", "attention")),
    ("fused norm/rope/swiglu (triton)", ("_add_rms_norm", "_rope_kv_write", "_swiglu", "_quantize_rows")),
    ("gemm", ("gemm", "gemv", "xmma", "cutlass", "nvjet", "sm90_", "splitk", "cublas")),
    ("kv write (torch)", ("index_copy", "indexing_backward", "index_put")),
    ("copy / cast", ("copy", "cast", "convert")),
    ("reduce", ("reduce",)),
]


def weight_bytes(dec: Decoder) -> int:
    """Bytes of every weight a step reads in full (see the module docstring); an FP8 decoder's
    projections count their E4M3 bytes and scales (its bf16 copies are released)."""
    total = sum(p.numel() * p.element_size() for p in dec.parameters())
    total += sum(q.nbytes for q in dec.fp8_layers or [])
    if dec.lm_head is not None:  # untied: the embedding table is only looked up
        emb = dec.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def step_bytes(dec: Decoder, batch: int, context: int) -> dict[str, int]:
    """The bytes model of one step: weights, KV read, KV written, and their total."""
    kv = dec.cfg.kv_bytes_per_token
    out = {"weights": weight_bytes(dec), "kv_read": batch * context * kv, "kv_written": batch * kv}
    out["total"] = sum(out.values())
    return out


def roofline(dec: Decoder, batch: int, context: int, step_ms: float, hbm_tb_s: float) -> dict[str, Any]:
    """The roofline entry of one configuration: bytes, roofline ms, fraction of it the step reached."""
    b = step_bytes(dec, batch, context)
    ms = b["total"] / (hbm_tb_s * 1e12) * 1e3
    return {"bytes": b, "roofline_ms": ms, "fraction": ms / step_ms, "x_roofline": step_ms / ms}


def prefill_flops(dec: Decoder, rows: int) -> dict[str, float]:
    """The FLOP model of one prefill of `rows` rows from position 0 (module docstring)."""
    cfg = dec.cfg
    hd, nh, kvh, h = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    per_layer = h * (nh + 2 * kvh) * hd + nh * hd * h + 3 * h * cfg.intermediate_size
    linear = 2.0 * rows * per_layer * cfg.num_layers
    attention = 2.0 * 2.0 * rows * rows / 2.0 * nh * hd * cfg.num_layers
    head = 2.0 * h * cfg.vocab_size * cfg.row_width
    return {"linear": linear, "attention": attention, "head": head, "total": linear + attention + head}


def prefill_roofline(dec: Decoder, rows: int, ms: float, peak_tflops: float) -> dict[str, Any]:
    """FLOPs, the tensor-core bound in ms and the fraction of the bf16 peak one prefill reached."""
    f = prefill_flops(dec, rows)
    bound_ms = f["total"] / (peak_tflops * 1e12) * 1e3
    return {
        "flops": f,
        "tflop_s": f["total"] / (ms / 1e3) / 1e12,
        "bound_ms": bound_ms,
        "tc_fraction": bound_ms / ms,
    }


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other elementwise"


def kernel_breakdown(step: Callable[[], object], device: torch.device, layers: int) -> dict[str, Any]:
    """Device time and launch count per kernel family of one call of `step` (run once before, untimed)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    fams: dict[str, dict[str, float]] = {}
    names: dict[str, dict[str, float]] = {}
    kernels = 0
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = evt.name
        if name.startswith(("Memcpy", "Memset", "[memory]")):
            fam = "memcpy / memset"
        else:
            fam = family(name)
            kernels += 1
        f = fams.setdefault(fam, {"us": 0.0, "launches": 0})
        f["us"] += evt.time_range.elapsed_us()
        f["launches"] += 1
        k = names.setdefault(name[:120], {"us": 0.0, "launches": 0})
        k["us"] += evt.time_range.elapsed_us()
        k["launches"] += 1
    total = sum(f["us"] for f in fams.values())
    return {
        "kernels": kernels,
        "kernels_per_layer": kernels / layers,
        "device_us": total,
        "families": dict(sorted(fams.items(), key=lambda kv: -kv[1]["us"])),
        "top_kernels": dict(sorted(names.items(), key=lambda kv: -kv[1]["us"])[:12]),
    }


DecodeFn = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], torch.Tensor]


def _event_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def bench_forward(
    dec: Decoder,
    pool: KVPool,
    decode: DecodeFn,
    graphed: GraphedDecode | None,
    batch: int,
    context: int,
    warmup: int,
    steps: int,
    hbm_tb_s: float,
) -> dict[str, Any]:
    """Forward-only decode steps of `batch` streams at `context` tokens (CUDA): medians of the whole
    call and of the replay alone, with the roofline of the device step (the replay when graphed)."""
    total = context + warmup + steps
    owned = [pool.allocate(pool.pages_for(total)) for _ in range(batch)]
    tables = [pool.slots(pages, total) for pages in owned]
    rows = torch.randint(0, dec.cfg.vocab_size, (batch, dec.cfg.row_width), device=pool.device)
    calls, replays = [], []
    for step in range(warmup + steps):
        pos = context + step
        slot_tables = [t[: pos + 1] for t in tables]
        positions = torch.full((batch,), pos, dtype=torch.long)
        calls.append(_event_ms(partial(decode, rows, slot_tables, positions)))
        replay = None if graphed is None else graphed.replay_of(batch, pos + 1)  # the graph, then the head
        if replay is not None:
            replays.append(_event_ms(replay))
    for pages in owned:
        pool.free(pages)
    call = benchutil.summary([t / 1e3 for t in calls[warmup:]])
    out: dict[str, Any] = {"batch": batch, "context": context, **{f"call_{k}": v for k, v in call.items()}}
    device_ms = call["median_ms"]
    if replays[warmup:]:
        rep = benchutil.summary([t / 1e3 for t in replays[warmup:]])
        out.update({f"replay_{k}": v for k, v in rep.items()})
        device_ms = rep["median_ms"]
    out["step_ms"] = device_ms
    out["roofline"] = roofline(dec, batch, context, device_ms, hbm_tb_s)
    return out


def print_tables(result: dict[str, Any]) -> None:
    """The forward table (step, roofline, fraction) and each breakdown, as Markdown."""
    if result.get("forward"):
        meta = result["meta"]
        print(f"\ndecode forward ({meta.get('kernels', '')}; roofline at {meta.get('hbm_tb_s')} TB/s)\n")
        print(
            benchutil.format_table(
                ["batch", "context", "step ms", "call ms", "roofline ms", "fraction", "x roofline"],
                [
                    [
                        f["batch"],
                        f["context"],
                        f["step_ms"],
                        f["call_median_ms"],
                        f["roofline"]["roofline_ms"],
                        f["roofline"]["fraction"],
                        f["roofline"]["x_roofline"],
                    ]
                    for f in result["forward"]
                ],
            )
        )
    for bd in result.get("breakdown", []):
        what = (
            f"one prefill of {bd['prefill_rows']} rows"
            if "prefill_rows" in bd
            else f"one eager step at batch {bd['batch']} x context {bd['context']}"
        )
        print(
            f"\n{what}: {bd['kernels']} kernels "
            f"({bd['kernels_per_layer']:.1f} per layer), {bd['device_us'] / 1e3:.2f} ms of device time\n"
        )
        print(
            benchutil.format_table(
                ["family", "launches", "device ms", "share"],
                [
                    [fam, int(f["launches"]), f["us"] / 1e3, f["us"] / max(bd["device_us"], 1e-9)]
                    for fam, f in bd["families"].items()
                ],
            )
        )


def _time_and_fraction_axes(
    ax1: Any, ax2: Any, xs: list[int], xlabel: str, time_label: str, frac_label: str
) -> None:
    """Both plots' axes: a log2 x axis ticked at `xs`, time from 0 on the left, a 0..1 fraction right."""
    for ax, title in ((ax1, time_label), (ax2, frac_label)):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, labels=[str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylim(bottom=0)
    ax2.set_ylim(0, 1)


def plot(result: dict[str, Any], path: Any) -> None:
    """Step time against roofline time per configuration (left) and the fraction reached (right)."""
    plt = benchutil.pyplot()
    if plt is None or not result.get("forward"):
        return
    meta, fw = result["meta"], result["forward"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ctx in sorted({f["context"] for f in fw}):
        pts = [f for f in fw if f["context"] == ctx]
        xs = [f["batch"] for f in pts]
        ax1.plot(xs, [f["step_ms"] for f in pts], "o-", label=f"step, context {ctx}")
        ax1.plot(xs, [f["roofline"]["roofline_ms"] for f in pts], "k--", alpha=0.5, label=f"roofline, {ctx}")
        ax2.plot(xs, [f["roofline"]["fraction"] for f in pts], "o-", label=f"context {ctx}")
    _time_and_fraction_axes(
        ax1,
        ax2,
        sorted({f["batch"] for f in fw}),
        "decode batch (streams)",
        "ms per step",
        "fraction of roofline",
    )
    benchutil.save_figure(
        plt,
        fig,
        path,
        f"decode forward {meta['preset']} {meta['dtype']} on {meta['device']} ({meta.get('kernels', '')}, "
        f"commit {meta['commit'][:10]})",
        fontsize=9,
    )


def plot_prefill(results: list[tuple[str, dict[str, Any]]], path: Any) -> None:
    """Prefill time (left) and tensor-core fraction (right) by prompt rows, one line per labelled result."""
    plt = benchutil.pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows: set[int] = set()
    for label, result in results:
        pts = [p for p in result["prefill"] if "tensor_cores" in p]
        xs = [p["prompt_rows"] for p in pts]
        rows.update(xs)
        ax1.plot(xs, [p["median_ms"] for p in pts], "o-", label=label)
        ax1.plot(xs, [p["tensor_cores"]["bound_ms"] for p in pts], "k--", alpha=0.4)
        ax2.plot(xs, [p["tensor_cores"]["tc_fraction"] for p in pts], "o-", label=label)
    peak = results[0][1]["meta"].get("tc_peak_tflops", H200_BF16_DENSE_TFLOPS)
    _time_and_fraction_axes(
        ax1,
        ax2,
        sorted(rows),
        "prompt rows (position 0)",
        "ms per prefill (dashed: FLOPs at the peak)",
        f"fraction of {peak:.0f} TFLOP/s",
    )
    benchutil.save_figure(plt, fig, path, f"prefill on {results[0][1]['meta']['device']}", fontsize=9)
