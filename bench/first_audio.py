"""`python -m tandem.bench.first_audio`: the first-audio waterfall of `tts` and `tts_mono` at one
stream, on the CPU, against the tests' Orpheus-format unit.

The unit is what `tests/integration/test_codec.py` serves: an Orpheus-layout LM (random weights,
156,940 ids, W = 1, its head large on the audio ids so every stream is audio) rendered by
`tandem-repo --checkpoint --codec` with SNAC (real 24 kHz config, random weights, noise off), under
the real tritonserver. `--requests` sequential greedy streams per model (24 prompt rows, 50 tokens)
after one first request, which is reported apart (it pays whatever is cold). Prints each stage's
median and writes `first-audio.json` into `--out`; `--set MODEL:KEY=VALUE` passes through to
tandem-repo (e.g. `vocoder:tandem.torch_threads=0`).

    python -m tandem.bench.first_audio --out /tmp/fa --requests 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.backend.codec.snac import write_random
from tandem.backend.generation.orpheus_ids import AUDIO_BASE, END_OF_SPEECH, SLOTS, VOCAB_SIZE
from tandem.backend.generation.orpheus_ids import CODES_PER_SLOT as CODEBOOK
from tandem.backend.model.checkpoint import save_checkpoint
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.decoder import Decoder
from tandem.backend.timing import FIRST_AUDIO_STAGES, waterfall
from tandem.bench import util as benchutil
from tandem.cli import make_repository
from tandem.gateway.client import TTSClient


def audio_lm(path: Path) -> Path:
    """The tests' Orpheus-layout LM: its head zero off the audio ids, so a greedy stream is audio."""
    cfg = ModelConfig(
        name="orpheus-layout-tiny",
        vocab_size=VOCAB_SIZE,
        row_width=1,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=4096,
        eos_token_id=END_OF_SPEECH,
    )
    decoder = Decoder.random(cfg, seed=3)
    assert decoder.lm_head is not None
    with torch.no_grad():
        head = decoder.lm_head.weight
        audio = slice(AUDIO_BASE, AUDIO_BASE + SLOTS * CODEBOOK)
        scaled = head[audio] * 8.0
        head.zero_()
        head[audio] = scaled
    save_checkpoint(decoder, path)
    return path


def measure(url: str, model: str, requests: int) -> dict[str, Any]:
    client = TTSClient(url, model)
    rows: list[dict[str, float]] = []
    first: dict[str, float] = {}
    for i in range(requests + 1):
        prompt = np.random.default_rng(i).integers(0, 128000, size=(24, 1), dtype=np.int64)
        (r,) = client.wait([client.send(prompt, MAX_TOKENS=50, TEMPERATURE=0.0)])
        if r.error is not None:
            raise SystemExit(f"{model}: {r.error}")
        stamps = {**r.timings, "client_first_audio": r.first_audio_ns}
        stages = dict(waterfall(stamps, FIRST_AUDIO_STAGES))
        if i == 0:
            first = stages
        else:
            rows.append(stages)
    median = {k: float(np.median([r[k] for r in rows if k in r])) for k in rows[0]}
    ttfa = [sum(r.values()) for r in rows]
    return {
        "stages_p50_ms": median,
        "ttfa_ms": {"p50": float(np.median(ttfa)), "p95": float(np.percentile(ttfa, 95))},
        "first_request_ms": first,
        "requests": requests,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-first-audio", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--models", default="tts,tts_mono")
    ap.add_argument("--set", action="append", default=[], help="MODEL:KEY=VALUE for tandem-repo")
    args = ap.parse_args(argv)
    from tests.support.server import TritonProcess  # the suite's server harness (real tritonserver)

    with tempfile.TemporaryDirectory(prefix="first-audio-") as tmp:
        work = Path(tmp)
        snac = write_random(work / "snac", noise=False)
        repo = work / "repo"
        render = ["--out", str(repo), "--checkpoint", str(audio_lm(work / "ckpt")), "--codec", str(snac)]
        for item in args.set:
            render += ["--set", item]
        if make_repository.main(render) != 0:
            return 1
        proc = TritonProcess(work / "server")
        proc.repo = repo
        proc.start(timeout_s=600)
        try:
            result: dict[str, Any] = {
                **benchutil.provenance(torch.device("cpu"), "tandem-bench-first-audio", sys.argv[1:]),
                "set": args.set,
                "models": {m: measure(proc.url, m, args.requests) for m in args.models.split(",") if m},
            }
        finally:
            proc.stop()
    for model, r in result["models"].items():
        stages = ", ".join(f"{k} {v:.1f}" for k, v in r["stages_p50_ms"].items())
        print(
            f"{model}: TTFA p50 {r['ttfa_ms']['p50']:.1f} ms, p95 {r['ttfa_ms']['p95']:.1f}; p50 ms: {stages}"
        )
        first = ", ".join(f"{k} {v:.1f}" for k, v in r["first_request_ms"].items() if "first" in k)
        print(f"{model}: first request: {first}")
    args.out.mkdir(parents=True, exist_ok=True)
    benchutil.write_json(args.out / "first-audio.json", result)
    print(f"wrote {args.out / 'first-audio.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
