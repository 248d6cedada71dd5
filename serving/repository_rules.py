"""What a deployment's choices mean for each model of the repository: `tandem-repo`'s rules.

Called once per repository by `tandem-repo` (cli/make_repository.py) and by the tests that render
one: `write_repository(RepositoryRequest(...))` turns a model (a preset, a checkpoint or the trial
Orpheus), its codec, its placement and its limits into per-model `tandem.*` parameters, instance
groups and tensor dims, and renders the checked-in repository with them (`serving/repository.py`).
It owns which model reads which parameter (the tuples below); what a family implies (its codec, its
voices, a request's default length) is the family's (`backend/text/families.py`).

The published `row_width`/`vocab_size` of `tts` and `tts_mono` are rewritten to the model's, and
`sample_rate`/`rows_per_second` to the codec's, since the models refuse to load when they disagree;
so are the dims of every row tensor ([-1, W]) and codec-frame tensor ([-1, K]): one variable
dimension each, or Triton lets a negative dimension through to the stub. A codec cuts chunks in
whole frames: the first one (1 + lookahead) frames, so it already sounds.

Failure: `RepositoryError` names the choice that cannot be rendered (a family without its codec, a
bad checkpoint or codec directory) before anything is written under `out`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.backend.codec.base import format_rate
from tandem.backend.codec.builder import codec_spec, layout
from tandem.backend.model.config import ModelConfig, preset
from tandem.backend.settings import parse_settings
from tandem.backend.text.families import (
    FAMILIES,
    FAMILY_CODECS,
    FAMILY_DEFAULT_ROWS,
    FAMILY_VOICES,
    check_csm_codec,
    checkpoint_config,
    detect_family,
    resolve_family,
)
from tandem.serving.api_key import UNIT_PARAMETER
from tandem.serving.repository import gpu_group, render, tensor_dims

SOURCE = Path(__file__).resolve().parent.parent / "model_repository"  # the checked-in CPU default
ENGINES = ("prefill", "decode", "tts_mono")
# D frames rows, the vocoder and tts_mono decode them, `voices` encodes references with it.
CODEC_USERS = ("decode", "vocoder", "tts_mono", "voices")
VOICE_USERS = ("frontend", "tts_mono", "voices")  # built-in voices and the store: who speaks, who registers
CHUNK_FRAMES_MAX = 16  # frames per chunk once grown (1.37 s of Orpheus audio)
# The models that read the family: the text front end (its template), P and tts_mono (the grammar
# they sample under and hand on to D).
FAMILY_USERS = ("frontend", "prefill", "tts_mono")

Setting = tuple[str, str, str]  # (model, key, value)


class RepositoryError(ValueError):
    """A request that cannot be rendered; the message names the choice."""


@dataclass(frozen=True)
class RepositoryRequest:
    """`tandem-repo`'s options (its --help says what each means); GPU lists are "0,1" strings."""

    out: Path
    source: Path = SOURCE
    preset: str | None = None
    checkpoint: str | None = None
    trial_orpheus: Path | None = None
    codec: str | None = None
    family: str | None = None
    vocoder_gpus: str | None = None
    voices: str | None = None
    voices_dir: str | None = None
    dtype: str | None = None
    prefill_gpus: str | None = None
    decode_gpus: str | None = None
    mono_gpus: str | None = None
    pool_pages: int | None = None
    max_batch: int | None = None
    unit: str | None = None
    path: str | None = None
    sets: tuple[Setting, ...] = ()  # any other parameter; wins over every rule


def parse_setting(item: str) -> Setting:
    """`MODEL:KEY=VALUE` as (model, key, value); ValueError if a part is missing."""
    model, _, kv = item.partition(":")
    key, _, value = kv.partition("=")
    if not (model and key and value):
        raise ValueError(f"wants MODEL:KEY=VALUE, got {item!r}")
    return model, key, value


def write_repository(req: RepositoryRequest, say: Callable[[str], None] = print) -> None:
    """Render the repository `req` asks for into `req.out`; `say` gets a line per thing written."""
    if req.trial_orpheus is not None:
        checkpoint, codec, trial_sets = _trial_orpheus(req.trial_orpheus, req.codec, say)
        req = dataclasses.replace(req, checkpoint=checkpoint, codec=codec, sets=(*trial_sets, *req.sets))
    params: dict[str, dict[str, str]] = {m: {} for m in ENGINES}
    params["frontend"] = {}  # the text front end reads the model's config (no weights) and its tokenizer
    params["voices"] = {}  # the registrar reads the model's config (row width), encodes with its codec
    cfg = _model_parameters(req, params)
    summary = _codec_parameters(req, cfg, params)
    for model, key, value in req.sets:
        params.setdefault(model, {})[key] = value
    codec_layout = params["decode"].get("tandem.codec.layout", "rows")
    dims = tensor_dims(cfg.row_width, layout(codec_layout).frame_width(cfg.row_width))
    render(req.source, req.out, params, _placement(req), dims)
    dtype = req.dtype or cfg.dtype
    say(f"wrote {req.out} ({cfg.name}: W={cfg.row_width}, V={cfg.vocab_size}, dtype {dtype}; {summary})")


def _model_parameters(req: RepositoryRequest, params: dict[str, dict[str, str]]) -> ModelConfig:
    """The model, its dtype, pool, batch, unit and KV path for the engines; returns its config."""
    if req.voices_dir:
        for m in VOICE_USERS:
            params[m]["tandem.voices.dir"] = str(Path(req.voices_dir).resolve())
    if req.checkpoint:
        try:
            cfg = checkpoint_config(Path(req.checkpoint))
        except ValueError as exc:
            raise RepositoryError(f"--checkpoint: {exc}") from None
        for m in (*ENGINES, "frontend", "voices"):
            params[m]["tandem.model.checkpoint"] = str(Path(req.checkpoint).resolve())
        for m in ("frontend", "tts_mono"):  # "": the checkpoint's own tokenizer.json (none: TEXT refused)
            params[m]["tandem.frontend.tokenizer"] = ""
    else:
        cfg = preset(req.preset or "tiny")
        for m in (*ENGINES, "frontend", "voices"):
            params[m]["tandem.model.preset"] = cfg.name
    for m in ENGINES:
        if req.dtype:
            params[m]["tandem.model.dtype"] = req.dtype
        if req.pool_pages:
            params[m]["tandem.pool.num_pages"] = str(req.pool_pages)
    if req.max_batch is not None:  # 0: D sizes it from its pool (up to 512)
        for m in ("decode", "tts_mono"):
            params[m]["tandem.batch.max_batch"] = str(req.max_batch)
    if req.unit:
        for m in ("prefill", "decode"):
            params[m][UNIT_PARAMETER] = req.unit
    path = req.path or ("cuda_ipc" if (req.prefill_gpus or req.decode_gpus) else None)
    if path:
        for m in ("prefill", "decode"):
            params[m]["tandem.transfer.paths"] = path
            params[m]["tandem.transfer.require_path"] = path
    for published in ("tts", "tts_mono"):
        params.setdefault(published, {})
        params[published]["row_width"] = str(cfg.row_width)
        params[published]["vocab_size"] = str(cfg.vocab_size)
    return cfg


def _codec_parameters(req: RepositoryRequest, cfg: ModelConfig, params: dict[str, dict[str, str]]) -> str:
    """Codec settings for every codec user, published rates, frame-aligned chunks; returns a summary.
    RepositoryError naming the problem for a family without its codec or a bad codec directory."""
    family = resolve_family(req.family, Path(req.checkpoint) if req.checkpoint else None, req.preset)
    if family and not req.codec:
        need = FAMILIES[family]
        raise RepositoryError(f"the {family} family needs its codec: --codec DIR ({need})")
    if family == "orpheus" and cfg.row_width != 1:
        raise RepositoryError(f"Orpheus emits one id per row, but the model has W={cfg.row_width}")
    if family == "csm" and not (req.checkpoint and detect_family(Path(req.checkpoint)) == "csm"):
        raise RepositoryError("--family csm needs a CSM checkpoint (config.json model_type 'csm')")
    codec: dict[str, str] = {}
    if req.codec:
        kind, codec_layout = FAMILY_CODECS.get(family or "", FAMILY_CODECS["orpheus"])
        codec = {"tandem.codec.kind": kind, "tandem.codec.path": str(Path(req.codec).resolve())}
        codec["tandem.codec.layout"] = codec_layout
    try:
        settings = parse_settings({k.removeprefix("tandem."): v for k, v in codec.items()})
        if family == "csm":
            assert req.checkpoint is not None and req.codec is not None  # both checked above
            check_csm_codec(Path(req.checkpoint), Path(req.codec))
    except ValueError as exc:
        raise RepositoryError(f"--codec: {exc}") from None
    spec = codec_spec(settings)
    for m in CODEC_USERS:
        params.setdefault(m, {}).update(codec)
    voices = req.voices if req.voices is not None else FAMILY_VOICES.get(family or "")
    if voices is None and req.checkpoint:
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
    if req.codec:
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


def _placement(req: RepositoryRequest) -> dict[str, str]:
    """Each placed model's instance groups: one instance per listed GPU (P and D: one over all)."""
    groups: dict[str, str] = {}
    for model, spec in (("prefill", req.prefill_gpus), ("decode", req.decode_gpus)):
        gpus = _gpus(spec)
        if gpus:
            groups[model] = gpu_group(gpus)
    vocoder = _gpus(req.vocoder_gpus)
    if vocoder:
        groups["vocoder"] = ", ".join(gpu_group([g]) for g in vocoder)
        groups["voices"] = gpu_group(vocoder[:1])  # the encoder beside the first vocoder's decoder
    mono = _gpus(req.mono_gpus)
    if mono:
        groups["tts_mono"] = ", ".join(gpu_group([g]) for g in mono)
    return groups


def _trial_orpheus(
    root: Path, codec: str | None, say: Callable[[str], None]
) -> tuple[str, str, list[Setting]]:
    """Write the trial checkpoint (`backend/text/trial.py`, Orpheus' voices listed) and, unless
    `codec` is given, random SNAC 24 kHz under `root`: (checkpoint, codec, the settings a CPU
    wants: no start-up calibration and no rate admission for a 156,940-id head)."""
    from tandem.backend.codec.snac import write_random
    from tandem.backend.text.trial import orpheus_checkpoint

    checkpoint = orpheus_checkpoint(root / "orpheus", voices=True)
    if codec is None:
        codec = str(write_random(root / "snac_24khz"))
    sets = [
        ("decode", "tandem.batch.calibrate_steps", "0"),
        ("decode", "tandem.batch.rate_admission", "false"),
    ]
    say(f"wrote the trial Orpheus checkpoint {checkpoint} and SNAC {codec} (random weights)")
    return str(checkpoint), codec, sets
