"""`tandem-repo`: render a model repository for a deployment from the checked-in CPU default.

    # PD on two GPUs (P on GPU0, D on GPU1) and the monolithic baseline on both, 4B-shape decoder:
    tandem-repo --out /srv/repo --preset qwen3-4b-shape --dtype bfloat16 \\
        --prefill-gpus 0 --decode-gpus 1 --mono-gpus 0,1 --pool-pages 8192
    # a real checkpoint (HF config.json + safetensors):
    tandem-repo --out /srv/repo --checkpoint /models/orpheus-3b --dtype bfloat16 \\
        --prefill-gpus 0 --decode-gpus 1

    # text in, audio out, offline on a CPU: a small random Orpheus-format checkpoint and SNAC:
    tandem-repo --out /tmp/trial-repo --trial-orpheus /tmp/trial-models

    # Orpheus (family detected from the checkpoint, or --family orpheus) with its SNAC 24 kHz codec;
    # its streams sample under Orpheus' audio-token grammar, tokenizer or none:
    tandem-repo --out /srv/repo --checkpoint /models/orpheus-3b --codec /models/snac_24khz \
        --dtype bfloat16 --prefill-gpus 0 --decode-gpus 1 --vocoder-gpus 1

The published `row_width`/`vocab_size` of `tts` and `tts_mono` are rewritten to the model's, and
`sample_rate`/`rows_per_second` to the codec's, since the models refuse to load when they disagree;
so are the dims of every row tensor ([-1, W]) and codec-frame tensor ([-1, K]): one variable
dimension each, or Triton lets a negative dimension through to the stub (serving/repository.py).
`--codec DIR` puts the family's codec behind D, the vocoder and `tts_mono` (SNAC: config.json +
pytorch_model.bin, for Orpheus and a model of no family; Mimi: config.json + model.safetensors, for
CSM), and cuts chunks in whole frames: the first one (1 + lookahead) frames, so it already sounds.

    # Sesame CSM (detected from its config.json) with Mimi; rendered, not yet served by the engines
    # (docs/codecs.md, "CSM"):
    tandem-repo --out /srv/repo --checkpoint /models/csm-1b --codec /models/mimi
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.backend.codec.base import format_rate
from tandem.backend.codec.builder import codec_spec, layout
from tandem.backend.model.config import ModelConfig, preset
from tandem.backend.settings import parse_settings
from tandem.backend.text.families import (
    FAMILIES,
    FAMILY_CODECS,
    PRESET_FAMILIES,
    check_csm_codec,
    checkpoint_config,
    detect_family,
)
from tandem.serving.repository import gpu_group, render, tensor_dims

SOURCE = Path(__file__).resolve().parent.parent / "model_repository"
ENGINES = ("prefill", "decode", "tts_mono")
# D frames rows, the vocoder and tts_mono decode them, `voices` encodes references with it.
CODEC_USERS = ("decode", "vocoder", "tts_mono", "voices")
VOICE_USERS = ("frontend", "tts_mono", "voices")  # built-in voices and the store: who speaks, who registers
# The voices of a family's fine-tuned checkpoint (canopyai/Orpheus-TTS, orpheus-3b-0.1-ft), which its
# config.json does not list.
FAMILY_VOICES = {"orpheus": "tara,leah,jess,leo,dan,mia,zac,zoe"}
CHUNK_FRAMES_MAX = 16  # frames per chunk once grown (1.37 s of Orpheus audio)
# A request's length when it names none (the OpenAI body never does): Orpheus' own engine asks for
# 1,200 tokens (14.6 s of audio), Sesame's generator for 90 s of audio (1,125 frames at 12.5/s).
FAMILY_DEFAULT_ROWS = {"orpheus": 1200, "csm": 1125}
# The models that read the family: the text front end (its template), P and tts_mono (the grammar
# they sample under and hand on to D).
FAMILY_USERS = ("frontend", "prefill", "tts_mono")


def _codec_parameters(args: argparse.Namespace, cfg: ModelConfig, params: dict[str, dict[str, str]]) -> str:
    """Codec settings for every codec user, published rates, frame-aligned chunks; returns a summary.
    Exits with a message naming the problem for a family without its codec or a bad codec directory."""
    if args.family:
        family: str | None = args.family
    elif args.checkpoint:
        family = detect_family(Path(args.checkpoint))
    else:
        family = PRESET_FAMILIES.get(args.preset or "")
    if family and not args.codec:
        need = FAMILIES[family]
        raise SystemExit(f"tandem-repo: the {family} family needs its codec: --codec DIR ({need})")
    if family == "orpheus" and cfg.row_width != 1:
        raise SystemExit(f"tandem-repo: Orpheus emits one id per row, but the model has W={cfg.row_width}")
    if family == "csm" and not (args.checkpoint and detect_family(Path(args.checkpoint)) == "csm"):
        raise SystemExit("tandem-repo: --family csm needs a CSM checkpoint (config.json model_type 'csm')")
    codec: dict[str, str] = {}
    if args.codec:
        kind, codec_layout = FAMILY_CODECS.get(family or "", FAMILY_CODECS["orpheus"])
        codec = {"tandem.codec.kind": kind, "tandem.codec.path": str(Path(args.codec).resolve())}
        codec["tandem.codec.layout"] = codec_layout
    try:
        settings = parse_settings({k.removeprefix("tandem."): v for k, v in codec.items()})
        if family == "csm":
            check_csm_codec(Path(args.checkpoint), Path(args.codec))
    except ValueError as exc:
        raise SystemExit(f"tandem-repo: --codec: {exc}") from None
    spec = codec_spec(settings)
    for m in CODEC_USERS:
        params.setdefault(m, {}).update(codec)
    voices = args.voices if args.voices is not None else FAMILY_VOICES.get(family or "")
    if voices is None and args.checkpoint:
        voices = ""  # the checkpoint's own `tandem_voices`, else no built-in voices
    if voices is not None:
        for m in VOICE_USERS:
            params.setdefault(m, {})["tandem.frontend.voices"] = voices
    if family in FAMILY_DEFAULT_ROWS:
        for m in ("prefill", "tts_mono"):  # the models that validate a request's length
            params.setdefault(m, {})["tandem.limits.default_new_rows"] = str(FAMILY_DEFAULT_ROWS[family])
        # The family, written out rather than left to detection: without a tokenizer (a preset, a
        # checkpoint that ships none) the text front end cannot detect it, and P and tts_mono would
        # then sample over the whole vocabulary; with it Orpheus samples under its audio-token
        # grammar from the first generated token (the grammar is auto), CSM's TEXT takes Sesame's
        # template. D samples with the grammar P hands it in each stream's sampling parameters.
        for m in FAMILY_USERS:
            params.setdefault(m, {})["tandem.frontend.family"] = family
    if args.codec:
        first = spec.rows_per_frame * (1 + spec.lookahead)
        for m in ("decode", "tts_mono", "vocoder"):  # the vocoder warms the windows they cut
            params[m]["tandem.batch.first_chunk_rows"] = str(first)
            params[m]["tandem.batch.max_chunk_rows"] = str(max(first, spec.rows_per_frame * CHUNK_FRAMES_MAX))
    for published in ("tts", "tts_mono"):
        params.setdefault(published, {})
        params[published]["sample_rate"] = str(spec.sample_rate)
        params[published]["rows_per_second"] = format_rate(spec.rows_per_second)
    floor = settings.batch.rate_floor_tok_s
    rate = spec.rows_per_second
    return f"codec {spec.kind} ({spec.layout}): real time {rate:g} rows/s, floor {floor:g} tok/s"


def _gpus(text: str | None) -> list[int] | None:
    return None if text is None else [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-repo", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--source", type=Path, default=SOURCE)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None)
    src.add_argument("--checkpoint", default=None)
    src.add_argument(
        "--trial-orpheus",
        type=Path,
        metavar="DIR",
        help="write a small random Orpheus-format checkpoint (with a tokenizer.json built by `tokenizers`) "
        "and random SNAC 24 kHz into DIR and serve them: text in, audio (noise) out, offline, on a CPU",
    )
    ap.add_argument(
        "--codec",
        help="the family's codec directory for the vocoder seam: SNAC (config.json + pytorch_model.bin), "
        "or Mimi (config.json + model.safetensors) for CSM",
    )
    ap.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        help="the model family; default: detected from --checkpoint (orpheus, csm), or the preset's "
        "(orpheus-3b-shape: orpheus)",
    )
    ap.add_argument("--vocoder-gpus", help="one vocoder instance per listed GPU (the codec decodes there)")
    ap.add_argument(
        "--voices",
        help="built-in voices, comma-separated ('*': any name); default: the family's (Orpheus: tara, "
        "leah, jess, leo, dan, mia, zac, zoe), else the checkpoint's tandem_voices, else none",
    )
    ap.add_argument(
        "--voices-dir",
        help="where registered voices are kept (absolute); default: $XDG_STATE_HOME/tandem/voices",
    )
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
    if args.trial_orpheus is not None:
        args.checkpoint, args.codec, trial_sets = _trial_orpheus(args.trial_orpheus, args.codec)
        args.set = [*trial_sets, *args.set]  # the caller's --set wins

    params: dict[str, dict[str, str]] = {m: {} for m in ENGINES}
    params["frontend"] = {}  # the text front end reads the model's config (no weights) and its tokenizer
    params["voices"] = {}  # the registrar reads the model's config (row width), encodes with its codec
    if args.voices_dir:
        for m in VOICE_USERS:
            params[m]["tandem.voices.dir"] = str(Path(args.voices_dir).resolve())
    if args.checkpoint:
        try:
            cfg = checkpoint_config(Path(args.checkpoint))
        except ValueError as exc:
            raise SystemExit(f"tandem-repo: --checkpoint: {exc}") from None
        for m in (*ENGINES, "frontend", "voices"):
            params[m]["tandem.model.checkpoint"] = str(Path(args.checkpoint).resolve())
        for m in ("frontend", "tts_mono"):  # "": the checkpoint's own tokenizer.json (none: TEXT refused)
            params[m]["tandem.frontend.tokenizer"] = ""
    else:
        cfg = preset(args.preset or "tiny")
        for m in (*ENGINES, "frontend", "voices"):
            params[m]["tandem.model.preset"] = cfg.name
    for m in ENGINES:
        if args.dtype:
            params[m]["tandem.model.dtype"] = args.dtype
        if args.pool_pages:
            params[m]["tandem.pool.num_pages"] = str(args.pool_pages)
    if args.max_batch is not None:  # 0: D sizes it from its pool (up to 512)
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
    summary = _codec_parameters(args, cfg, params)
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
    vocoder = _gpus(args.vocoder_gpus)
    if vocoder:
        groups["vocoder"] = ", ".join(gpu_group([g]) for g in vocoder)
        groups["voices"] = gpu_group(vocoder[:1])  # the encoder beside the first vocoder's decoder
    mono = _gpus(args.mono_gpus)
    if mono:
        groups["tts_mono"] = ", ".join(gpu_group([g]) for g in mono)
    codec_layout = params["decode"].get("tandem.codec.layout", "rows")
    dims = tensor_dims(cfg.row_width, layout(codec_layout).frame_width(cfg.row_width))
    render(args.source, args.out, params, groups, dims)
    dtype = args.dtype or cfg.dtype
    print(f"wrote {args.out} ({cfg.name}: W={cfg.row_width}, V={cfg.vocab_size}, dtype {dtype}; {summary})")
    return 0


def _trial_orpheus(root: Path, codec: str | None) -> tuple[str, str, list[str]]:
    """Write the trial checkpoint (`backend/text/trial.py`, Orpheus' voices listed) and, unless
    `codec` is given, random SNAC 24 kHz under `root`: (checkpoint, codec, the --set items a CPU
    wants: no start-up calibration and no rate admission for a 156,940-id head)."""
    from tandem.backend.codec.snac import write_random
    from tandem.backend.text.trial import orpheus_checkpoint

    checkpoint = orpheus_checkpoint(root / "orpheus", voices=True)
    if codec is None:
        codec = str(write_random(root / "snac_24khz"))
    sets = ["decode:tandem.batch.calibrate_steps=0", "decode:tandem.batch.rate_admission=false"]
    print(f"wrote the trial Orpheus checkpoint {checkpoint} and SNAC {codec} (random weights)")
    return str(checkpoint), codec, sets


if __name__ == "__main__":
    raise SystemExit(main())
