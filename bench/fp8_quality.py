"""`tandem-bench-fp8`: the FP8 quality guard, FP8 logits against bf16's over a greedy run.

    tandem-bench-fp8 --preset orpheus-3b-shape --device cuda --steps 256 --out results/

What it measures (the guard FP8 must pass before it serves: per-step logits cosine >= 0.999 with FP8
weights, >= 0.995 with FP8 weights and KV): the preset with random weights (`--seed`) in bf16 prefills a
random prompt (`--prompt-rows`, seeded) and decodes `--steps` greedy steps; its tokens and logits are the
reference. Each variant (`fp8-weights`: tandem.model.dtype=fp8; `fp8-weights-kv`: that and
tandem.kv.dtype=fp8; `fp8-kv`: the KV alone) is the same weights quantised, run *teacher-forced* on the
reference's tokens: with random weights two greedy runs part ways at the first near-tie of the argmax and
every later step would compare different contexts, so each step feeds the variant the bf16 run's token and
compares the two logit vectors of the same context. Step 0 is the prefill's last row; step i >= 1 the
decode step that takes token i-1. Per step: cosine of the float32 logits (flattened over the row's W
columns, in float64), and whether the argmax agrees. Both runs go through the engines' paths
(`Decoder.prefill`, `Decoder.decode`; on a GPU the paged kernel, eager, batch 1).

`--emulate` runs the FP8 maths from dequantised operands (the CPU's only way; what the unit tests use).
The controls (`CONTROLS`: the projections rounded to E4M3 but run in bf16, and bf16 with random
relative noise of the same size) run by default beside the variants: random weights amplify any
relative error of the projections layer by layer (the JSON records how much), which bounds what any
8-bit format can reach on them.
Writes <out>/<name>.json (provenance, per-step figures, summary) and <out>/<name>.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from tandem.backend.kv.pool import KVPool
from tandem.backend.model.config import ModelConfig, preset
from tandem.backend.model.decoder import Decoder
from tandem.bench import util as benchutil

# variant -> (weights, kv, the cosine floor FP8 must meet; 0: reported, no floor)
VARIANTS: dict[str, tuple[bool, bool, float]] = {
    "fp8-weights": (True, False, 0.999),
    "fp8-weights-kv": (True, True, 0.995),
    "fp8-kv": (False, True, 0.0),
}
# Controls (no FP8 kernel; what the model does with the same size of error): the projections
# rounded to their E4M3 values and run in bf16 (weight rounding alone, no activation quantisation),
# and the bf16 projections times (1 + N(0, e)) with e each tensor's relative rounding error under E4M3
# (the same error energy without E4M3's structure). With random weights these show how much of the
# gap is the model's own sensitivity.
CONTROLS = ("w8-dequantised", "bf16-noise")


def _perturb(dec: Decoder, control: str, seed: int) -> None:
    """Apply a control (`CONTROLS`) to the decoder's projections in place."""
    from tandem.backend.model.fp8 import quantize_weight

    gen = torch.Generator(device=dec.device).manual_seed(seed + 7)
    for name, param in dec.named_parameters():
        if not name.endswith("proj.weight"):
            continue
        rounded = quantize_weight(param).dequantize(param.dtype)
        if control == "w8-dequantised":
            param.copy_(rounded)
        else:
            err = ((rounded.float() - param.float()).norm() / param.float().norm()).item()
            noise = torch.randn(param.shape, device=param.device, generator=gen) * err
            param.copy_((param.float() * (1 + noise)).to(param.dtype))


def run(
    dec: Decoder, prompt: torch.Tensor, steps: int, forced: torch.Tensor | None, page_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill `prompt` [T, W], then `steps` - 1 decode steps, each fed `forced[i]` (the reference's
    token rows) or, without `forced`, its own argmax. Returns (tokens [steps, W], logits [steps, W, V]
    float32): step i's logits and the argmax taken from them."""
    cfg = dec.cfg
    total = prompt.shape[0] + steps
    pool = KVPool(dec.kv_layout(), -(-total // page_size), page_size, dec.device)
    slots = pool.slots(pool.allocate(pool.pages_for(total)), total)
    t = prompt.shape[0]
    logits = [dec.prefill(prompt, pool, slots[:t], 0)]
    tokens = [logits[0].argmax(-1)]
    for i in range(1, steps):
        row = (tokens[-1] if forced is None else forced[i - 1].to(dec.device))[None, :]
        pos = t + i - 1
        out = dec.decode(row, pool, [slots[: pos + 1]], torch.tensor([pos]))[0]
        logits.append(out)
        tokens.append(out.argmax(-1))
    del pool
    return torch.stack(tokens).reshape(steps, cfg.row_width), torch.stack(logits)


def compare(ref: torch.Tensor, test: torch.Tensor) -> dict[str, Any]:
    """Per-step cosine and argmax agreement of logits [steps, W, V] (float64 arithmetic)."""
    a, b = ref.flatten(1).double(), test.flatten(1).double()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1)
    agree = (ref.argmax(-1) == test.argmax(-1)).all(-1)
    c = cos.cpu()
    return {
        "cosine": [float(v) for v in c],
        "argmax_agrees": [bool(v) for v in agree.cpu()],
        "cosine_min": float(c.min()),
        "cosine_p01": float(torch.quantile(c, 0.01)),
        "cosine_mean": float(c.mean()),
        "argmax_agreement": float(agree.float().mean()),
        "worst_step": int(c.argmin()),
    }


def quality(
    cfg: ModelConfig,
    device: torch.device,
    seed: int,
    prompt_rows: int,
    steps: int,
    variants: list[str],
    emulate: bool = False,
) -> dict[str, Any]:
    """The reference run and each variant against it (the module's docstring)."""
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_rows, cfg.row_width), generator=gen)
    ref_dec = Decoder.random(cfg, device, seed=seed)
    ref_tokens, ref_logits = run(ref_dec, prompt, steps, None)
    del ref_dec
    out: dict[str, Any] = {"reference_tokens": ref_tokens.cpu().tolist(), "variants": {}}
    for name in variants:
        dec = Decoder.random(cfg, device, seed=seed)
        if name in CONTROLS:
            _perturb(dec, name, seed)
            floor = 0.0
        else:
            weights, kv, floor = VARIANTS[name]
            dec.quantize_fp8(weights=weights, kv=kv, emulate=emulate)
        _, logits = run(dec, prompt, steps, ref_tokens)
        del dec
        res = compare(ref_logits, logits)
        res["floor"] = floor
        res["meets_floor"] = res["cosine_min"] >= floor
        out["variants"][name] = res
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    plt = benchutil.pyplot()
    if plt is None:
        return
    meta = result["meta"]
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, res in result["variants"].items():
        ax.plot(res["cosine"], label=f"{name} (min {res['cosine_min']:.5f})", linewidth=1)
        if res["floor"]:
            ax.axhline(res["floor"], linestyle="--", linewidth=0.8, color=ax.lines[-1].get_color())
    ax.set_xlabel("step (teacher-forced on the bf16 run's tokens)")
    ax.set_ylabel("logits cosine against bf16")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    benchutil.save_figure(
        plt,
        fig,
        path,
        f"FP8 quality, {meta['preset']} (random weights, seed {meta['seed']}) on {meta['device']}, "
        f"commit {meta['commit'][:10]}",
    )


def print_tables(result: dict[str, Any]) -> None:
    meta = result["meta"]
    print(
        f"\nFP8 quality, {meta['preset']} on {meta['device']}, {meta['steps']} steps teacher-forced, "
        f"commit {meta['commit']}\n"
    )
    rows = []
    for name, r in result["variants"].items():
        floor = f">= {r['floor']}" if r["floor"] else "-"
        ok = ("yes" if r["meets_floor"] else "NO") if r["floor"] else "-"
        rows.append(
            [
                name,
                *(f"{r[k]:.5f}" for k in ("cosine_min", "cosine_p01", "cosine_mean")),
                r["argmax_agreement"],
                r["worst_step"],
                floor,
                ok,
            ]
        )
    print(
        benchutil.format_table(
            ["variant", "cos min", "cos p01", "cos mean", "argmax agrees", "worst step", "floor", "met"], rows
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-fp8", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="orpheus-3b-shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", help="the reference's dtype (FP8 computes in it)")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--prompt-rows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    known = (*VARIANTS, *CONTROLS)
    ap.add_argument("--variants", default=",".join(known), help=f"comma list of {', '.join(known)}")
    ap.add_argument("--emulate", action="store_true", help="FP8 maths from dequantised operands (CPU)")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--name", help="file stem (default: fp8-quality-<preset>-<device type>)")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if bad := [v for v in variants if v not in known]:
        ap.error(f"unknown variants {bad}; known: {', '.join(known)}")
    if args.steps < 1 or args.prompt_rows < 1:
        ap.error("--steps and --prompt-rows must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = preset(args.preset).with_dtype(benchutil.DTYPE_ALIASES.get(args.dtype, args.dtype))
    with torch.inference_mode():
        result = quality(cfg, device, args.seed, args.prompt_rows, args.steps, variants, args.emulate)
    result["meta"] = {
        **benchutil.provenance(device, "tandem-bench-fp8", argv),
        "benchmark": "fp8-quality",
        "preset": cfg.name,
        "dtype": cfg.dtype,
        "seed": args.seed,
        "steps": args.steps,
        "prompt_rows": args.prompt_rows,
        "emulate": args.emulate,
        "method": "teacher-forced on the bf16 greedy run's tokens; cosine of float32 logits per step",
    }
    name = args.name or f"fp8-quality-{cfg.name}-{device.type}"
    benchutil.save_result(args.out, name, result, plot, print_tables)
    return 0 if all(r["meets_floor"] or not r["floor"] for r in result["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
