"""`tandem-repo`: render a model repository for a deployment from the checked-in CPU default.

    # PD on two GPUs (P on GPU0, D on GPU1) and the monolithic baseline on both, 4B-shape decoder:
    tandem-repo --out /srv/repo --preset qwen3-4b-shape --dtype bfloat16 \\
        --prefill-gpus 0 --decode-gpus 1 --mono-gpus 0,1 --pool-pages 8192
    # a real checkpoint (HF config.json + safetensors):
    tandem-repo --out /srv/repo --checkpoint /models/orpheus-3b --dtype bfloat16 \\
        --prefill-gpus 0 --decode-gpus 1

The published `row_width`/`vocab_size` of `tts` and `tts_mono` are rewritten to the model's, since
the models refuse to load when they disagree.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.backend.checkpoint import config_from_hf
from tandem.backend.config import preset
from tandem.serving.repository import gpu_group, render

SOURCE = Path(__file__).resolve().parent.parent / "model_repository"
ENGINES = ("prefill", "decode", "tts_mono")


def _gpus(text: str | None) -> list[int] | None:
    return None if text is None else [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-repo", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--source", type=Path, default=SOURCE)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None)
    src.add_argument("--checkpoint", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prefill-gpus")
    ap.add_argument("--decode-gpus")
    ap.add_argument("--mono-gpus", help="one tts_mono instance per listed GPU")
    ap.add_argument("--pool-pages", type=int)
    ap.add_argument("--max-batch", type=int)
    ap.add_argument("--unit", help="transfer unit name (socket dir, lock names)")
    ap.add_argument(
        "--path",
        help="KV transfer path P and D require (host_shm, cuda_ipc, cuda_vmm, proxy, tcp); "
        "default: cuda_ipc when P or D is placed on a GPU, else the repository's (host_shm)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODEL:KEY=VALUE",
        help="any other tandem.* parameter, e.g. decode:tandem.transfer.deadline_s=2",
    )
    args = ap.parse_args(argv)

    params: dict[str, dict[str, str]] = {m: {} for m in ENGINES}
    params["frontend"] = {}  # the text front end reads the model's config (no weights) and its tokenizer
    if args.checkpoint:
        cfg = config_from_hf(json.loads((Path(args.checkpoint) / "config.json").read_text()))
        for m in (*ENGINES, "frontend"):
            params[m]["tandem.model.checkpoint"] = str(Path(args.checkpoint).resolve())
        for m in ("frontend", "tts_mono"):  # "": the checkpoint's own tokenizer.json (none: TEXT refused)
            params[m]["tandem.frontend.tokenizer"] = ""
    else:
        cfg = preset(args.preset or "tiny")
        for m in (*ENGINES, "frontend"):
            params[m]["tandem.model.preset"] = cfg.name
    for m in ENGINES:
        if args.dtype:
            params[m]["tandem.model.dtype"] = args.dtype
        if args.pool_pages:
            params[m]["tandem.pool.num_pages"] = str(args.pool_pages)
    if args.max_batch:
        for m in ("decode", "tts_mono"):
            params[m]["tandem.batch.max_batch"] = str(args.max_batch)
    if args.unit:
        for m in ("prefill", "decode"):
            params[m]["tandem.transfer.unit"] = args.unit
    path = args.path or ("cuda_ipc" if (args.prefill_gpus or args.decode_gpus) else None)
    if path:
        for m in ("prefill", "decode"):
            params[m]["tandem.transfer.paths"] = path
            params[m]["tandem.transfer.require_path"] = path
    for published in ("tts", "tts_mono"):
        params.setdefault(published, {})
        params[published]["row_width"] = str(cfg.row_width)
        params[published]["vocab_size"] = str(cfg.vocab_size)
    for item in args.set:
        model, _, kv = item.partition(":")
        key, _, value = kv.partition("=")
        if not (model and key and value):
            ap.error(f"--set wants MODEL:KEY=VALUE, got {item!r}")
        params.setdefault(model, {})[key] = value

    groups: dict[str, str] = {}
    for model, spec in (("prefill", args.prefill_gpus), ("decode", args.decode_gpus)):
        gpus = _gpus(spec)
        if gpus:
            groups[model] = gpu_group(gpus)
    mono = _gpus(args.mono_gpus)
    if mono:
        groups["tts_mono"] = ", ".join(gpu_group([g]) for g in mono)
    render(args.source, args.out, params, groups)
    dtype = args.dtype or cfg.dtype
    print(f"wrote {args.out} ({cfg.name}: W={cfg.row_width}, V={cfg.vocab_size}, dtype {dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
