"""Typed engine settings, parsed from a model's `config.pbtxt` `parameters`.

Triton hands every parameter as a string; this is the one place those strings become typed values,
with an error that names the parameter when one is malformed. Unknown keys are rejected so a typo
in a deployment is a load failure, not a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tandem.backend.codec.builder import codec_spec
from tandem.backend.codec.config import CodecSettings, VocoderConfig
from tandem.transfer.control import DEFAULT_UNIT


@dataclass(frozen=True)
class Limits:
    """Per-request bounds every entry point enforces before allocating anything."""

    max_prompt_rows: int = 4096
    max_new_rows: int = 2048
    default_new_rows: int = 256


# `tandem.model.dtype` values: "" keeps the checkpoint's / preset's; fp8 is bfloat16 compute with E4M3
# projections (backend/model/fp8.py), which only a GPU of compute capability 8.9+ runs.
MODEL_DTYPES = ("", "float32", "bfloat16", "float16", "fp8")
# `tandem.kv.dtype` values: auto stores the KV in the model's compute dtype; fp8 in E4M3 with per-head
# scales (GPU, 8.9+).
KV_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class ModelSource:
    preset: str = "tiny"
    checkpoint: str = ""  # a directory with config.json + *.safetensors; overrides preset
    dtype: str = ""  # one of MODEL_DTYPES ("" keeps the preset's / checkpoint's dtype)
    seed: int = 0  # random-weight seed for presets


@dataclass(frozen=True)
class KVSettings:
    """The KV cache's storage: `dtype` auto (the model's compute dtype) or fp8 (E4M3, static per-head
    scales from the weights; P and D must both say it, or their hand-off refuses)."""

    dtype: str = "auto"


@dataclass(frozen=True)
class PoolSettings:
    num_pages: int = 4096
    page_size: int = 16
    prefix_cache: bool = True
    # > 0 (CUDA only): the pool takes this fraction of the device's total memory, num_pages ignored
    # (engines/parts.size_from_device); engines sharing a GPU each name their share.
    memory_fraction: float = 0.0


@dataclass(frozen=True)
class BatchSettings:
    max_batch: int = 64  # 0: as many as the pool has pages for, up to MAX_BATCH (512)
    max_queue: int = 256
    admission_timeout_s: float = 5.0
    # Chunk sizes (backend/codec/chunking.py): the first chunk, then the largest rung of a ladder
    # (min_chunk_rows, x chunk_growth, ..., max_chunk_rows) whose audio is at most chunk_lead_fraction
    # of the seconds a real-time listener has buffered; chunk_lead_fraction 0: the fixed schedule
    # first * growth**i. min_chunk_rows 0: one codec frame.
    first_chunk_rows: int = 4
    chunk_growth: float = 2.0
    max_chunk_rows: int = 32
    chunk_lead_fraction: float = 0.5
    min_chunk_rows: int = 0
    # The rate floor in tok/s. Left out of the parameters (or 0): the codec's real time over the RTF
    # target `rate.rtf` (42 for the reference codec's 21 rows/s, 164.06 for Orpheus' 82.03), resolved
    # by `parse_settings`; a value > 0 overrides it. It always holds the floor in force.
    rate_floor_tok_s: float = 42.0
    rate_margin: float = 0.2  # admit only if predicted step time <= (1 - margin) / floor
    rate_admission: bool = True
    cuda_graphs: bool = True  # replay captured decode steps on CUDA devices (backend/model/cuda_graphs.py)
    paged_attention: bool = True  # decode attention reads KV in place (csrc/decode_attention.cu) where built
    graph_warmup_context: int = 0  # >0: capture every bucket up to this context at start (no lazy stalls)
    # D, before its first admission: time this many steps of its own loop at a few batch sizes and
    # contexts up to `calibrate_context`, and seed the rate-floor step model with them (0: off).
    calibrate_steps: int = 4
    calibrate_context: int = 2048
    prefill_batch_max: int = 16  # prompts that queued while a prefill ran go through one forward, up to this
    prefill_batch_rows: int = 8192  # ...and up to this many rows to compute (a longer prompt runs alone)


@dataclass(frozen=True)
class RateSettings:
    """Real time as an RTF target: every stream must generate audio at least 1/rtf times faster than
    it plays (0.5: twice real time). `batch.rate_floor_tok_s` > 0 overrides it in tok/s."""

    rtf: float = 0.5


@dataclass(frozen=True)
class TransferSettings:
    unit: str = DEFAULT_UNIT
    paths: str = "host_shm"  # comma-separated preference order
    require_path: str = ""  # non-empty: refuse to start on any other path
    deadline_s: float = 5.0
    ticket_ttl_s: float = 30.0
    arena_mb: int = 256  # D's receive arena (region mode only; direct mode's arena is D's pool)
    # P writes D's pool pages itself where the path can (host_shm for CPU engines, cuda_ipc, cuda_vmm):
    # no staging, no receive region, no scatter. false: every path copies into a receive region.
    direct_write: bool = True
    abort_retry_s: float = 0.2
    probe_interval_s: float = 0.5
    max_held_acks: int = 3
    drain_held_fraction: float = 0.25
    # Cross-host (docs/protocol.md, "Control plane over TCP"): "tcp" serves P's control plane on a TCP
    # port instead of the unit socket; only with paths = require_path = "tcp".
    control: str = "unix"
    bind_host: str = "127.0.0.1"  # P's control listener and D's tcp data listener bind here
    advertise_host: str = ""  # the address peers are told to connect to ("" = bind_host)
    secret_file: str = ""  # the unit secret both hosts mount ("" = <control dir>/tcp.secret, one host)


@dataclass(frozen=True)
class FrontendSettings:
    """The text front end (`backend/text/frontend.py`): TEXT/VOICE -> prompt rows, on `frontend`
    and `tts_mono`.

    `tokenizer` is a `tokenizer.json`; a relative path is relative to the model's directory in the
    repository; "" means `<tandem.model.checkpoint>/tokenizer.json`, and without a checkpoint the
    model takes no TEXT. `family` is auto (detected from the tokenizer and config), plain, orpheus or csm.
    `voices` (comma-separated) lists the model's built-in VOICEs; "" takes the checkpoint's list
    (`tandem_voices` in its config.json) and, without one, there are none; "*" takes any name as a
    built-in voice. Besides those, a request may name a registered voice (`VoiceSettings`). `family`
    and `grammar` are also read by `prefill` and `tts_mono`, which sample under the family's grammar.
    """

    tokenizer: str = ""
    family: str = "auto"
    voices: str = ""
    max_text_bytes: int = 4096
    grammar: str = (
        "auto"  # the audio-token grammar (backend/generation/grammar.py): auto (on for Orpheus), off, orpheus
    )


@dataclass(frozen=True)
class VoiceSettings:
    """Registered voices (`backend/voices/`, docs/operations.md "Registered voices"): where they are
    kept and what a reference recording may be. Read by `voices` (which writes the store) and by the
    models that speak with them (`frontend`, `tts_mono`); all three must name the same `dir`.

    `dir` "" is `$XDG_STATE_HOME/tandem/voices` (`~/.local/state/tandem/voices` without it): state
    that survives a reboot, unlike `$XDG_RUNTIME_DIR`. A reference is `min_seconds`..`max_seconds`
    long, its file at most `max_file_bytes`, its transcript 1..`max_transcript_bytes` UTF-8 bytes;
    `max_pending` registrations wait for the encoder at most (one more is UNAVAILABLE); the store
    holds at most `max_voices` (one more registration is UNAVAILABLE until one is deleted)."""

    dir: str = ""
    max_file_bytes: int = 16 * 2**20
    min_seconds: float = 1.0
    max_seconds: float = 30.0
    max_transcript_bytes: int = 1024
    max_pending: int = 4
    max_voices: int = 256


@dataclass(frozen=True)
class FaultSettings:
    """The seam fault drills plug into (backend/engines/faults.py); off in production.

    `hook`: an absolute path to a Python file whose `make_copy_hook(options: dict)` returns the
    function P's transfer sender calls on every copy, before it crosses (`copy_hook(transfer_id,
    staging)`: it may sleep or change the staged bytes; in direct mode `staging` is the first row, and
    P's rows still go by the production write, the altered row landing after it). `options`: a JSON
    object handed to it. "" = no hook, and P's copy path runs nothing extra. The fault-matrix tests
    plug in tests/support/fault_hooks.py.
    """

    hook: str = ""
    options: str = "{}"


@dataclass(frozen=True)
class WorkerSettings:
    """The engine's worker process and its supervision by the stub (serving/engine_worker.py).

    `stall_timeout_s`: a request waits at most this long for an engine that stopped answering (no
    Beat, or its loop stuck in one iteration), then gets `[UNAVAILABLE] <model>: engine not
    responding`; so does every request while it stays stalled. `beat_s`: the worker's heartbeat.
    `start_timeout_s`: one worker's start (decoder build, calibration, graph capture) before it counts
    as failed. A dead worker is started again after `restart_backoff_s`, doubling per failed start up
    to `restart_backoff_max_s` (tenacity), for as long as the model is loaded.
    """

    stall_timeout_s: float = 5.0
    beat_s: float = 0.1
    start_timeout_s: float = 600.0
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 10.0
    stop_timeout_s: float = 15.0


@dataclass(frozen=True)
class EngineSettings:
    model: ModelSource = field(default_factory=ModelSource)
    kv: KVSettings = field(default_factory=KVSettings)
    device: str = "auto"  # auto: the instance's GPU for KIND_GPU instances, else cpu
    pool: PoolSettings = field(default_factory=PoolSettings)
    batch: BatchSettings = field(default_factory=BatchSettings)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    limits: Limits = field(default_factory=Limits)
    vocoder: VocoderConfig = field(default_factory=VocoderConfig)
    faults: FaultSettings = field(default_factory=FaultSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    frontend: FrontendSettings = field(default_factory=FrontendSettings)
    codec: CodecSettings = field(default_factory=CodecSettings)
    rate: RateSettings = field(default_factory=RateSettings)
    voices: VoiceSettings = field(default_factory=VoiceSettings)
    torch_threads: int = 0  # 0: torch's default


# parameter key -> (section, field). Section "" is EngineSettings itself.
_SECTIONS = {
    "model": "model",
    "kv": "kv",
    "pool": "pool",
    "batch": "batch",
    "transfer": "transfer",
    "limits": "limits",
    "vocoder": "vocoder",
    "faults": "faults",
    "worker": "worker",
    "frontend": "frontend",
    "codec": "codec",
    "rate": "rate",
    "voices": "voices",
}


def _convert(kind: Any, raw: str, key: str) -> Any:
    try:
        if kind in (bool, "bool"):
            low = raw.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return low in ("1", "true", "yes")
        if kind in (int, "int"):
            return int(raw)
        if kind in (float, "float"):
            return float(raw)
        return raw
    except ValueError:
        raise ValueError(f"parameter {key!r}: cannot parse {raw!r} as {kind}") from None


def parse_settings(params: Mapping[str, str]) -> EngineSettings:
    """Build settings from `{"pool.num_pages": "2048", "device": "cpu", ...}` (dotted keys by section)."""
    base = EngineSettings()
    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    top: dict[str, Any] = {}
    for key, raw in params.items():
        section, _, name = key.rpartition(".")
        if section and section not in _SECTIONS:
            raise ValueError(f"unknown parameter {key!r}")
        target = getattr(base, section) if section else base
        fields = {f.name: f for f in dataclasses.fields(target)}
        if name not in fields or (not section and name in _SECTIONS):
            raise ValueError(f"unknown parameter {key!r}")
        value = _convert(fields[name].type, raw, key)
        (sections[section] if section else top)[name] = value
    built = {name: dataclasses.replace(getattr(base, name), **values) for name, values in sections.items()}
    explicit_floor = "batch.rate_floor_tok_s" in params
    settings = dataclasses.replace(base, **built, **top)
    _check_dtypes(settings)
    _check_capacity(settings)
    _check_chunks(settings.batch)
    _check_transfer(settings.transfer)
    return _with_rate_floor(settings, explicit_floor)


def _check_dtypes(settings: EngineSettings) -> None:
    """`model.dtype` and `kv.dtype` name known storages (whether the device runs FP8 is checked where
    the decoder is built, `engines/parts.build_decoder`, since only there is the device known)."""
    if settings.model.dtype not in MODEL_DTYPES:
        raise ValueError(
            f"parameter 'model.dtype': {settings.model.dtype!r} is not one of {', '.join(MODEL_DTYPES[1:])} "
            "(or empty: the checkpoint's)"
        )
    if settings.kv.dtype not in KV_DTYPES:
        raise ValueError(f"parameter 'kv.dtype': {settings.kv.dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if settings.kv.dtype == "fp8" and settings.model.dtype == "float32":
        raise ValueError(
            "parameter 'kv.dtype': fp8 KV is read by the bf16/fp16 attention kernel, not float32"
        )


MAX_BATCH = 512  # the largest decode batch (graphs are captured per bucket up to it)


def _check_capacity(settings: EngineSettings) -> None:
    b, p = settings.batch, settings.pool
    if not 0 <= b.max_batch <= MAX_BATCH:
        raise ValueError(
            f"parameter 'batch.max_batch': must be in [0, {MAX_BATCH}] (0: from the pool), got {b.max_batch}"
        )
    if not 0.0 <= p.memory_fraction < 1.0:
        raise ValueError(
            f"parameter 'pool.memory_fraction': must be in [0, 1) (0: num_pages), got {p.memory_fraction}"
        )


def _check_chunks(b: BatchSettings) -> None:
    """The chunk settings (`ChunkPolicy` checks them again, naming its own fields)."""
    if b.first_chunk_rows < 1:
        raise ValueError(f"parameter 'batch.first_chunk_rows': must be >= 1, got {b.first_chunk_rows}")
    if not (math.isfinite(b.chunk_growth) and b.chunk_growth >= 1.0):
        raise ValueError(
            f"parameter 'batch.chunk_growth': must be a finite number >= 1, got {b.chunk_growth}"
        )
    if b.max_chunk_rows < b.first_chunk_rows:
        raise ValueError(
            f"parameter 'batch.max_chunk_rows': must be >= batch.first_chunk_rows ({b.first_chunk_rows}), "
            f"got {b.max_chunk_rows}"
        )
    if not (math.isfinite(b.chunk_lead_fraction) and 0.0 <= b.chunk_lead_fraction <= 1.0):
        raise ValueError(
            "parameter 'batch.chunk_lead_fraction': must be in [0, 1] (0: fixed sizes), "
            f"got {b.chunk_lead_fraction}"
        )
    if not 0 <= b.min_chunk_rows <= b.max_chunk_rows:
        raise ValueError(
            f"parameter 'batch.min_chunk_rows': must be in [0, batch.max_chunk_rows={b.max_chunk_rows}] "
            f"(0: one codec frame), got {b.min_chunk_rows}"
        )


def _check_transfer(t: TransferSettings) -> None:
    """The transfer settings' cross-field rules (each engine that moves KV relies on them)."""
    if t.control not in ("unix", "tcp"):
        raise ValueError(f"parameter 'transfer.control': must be 'unix' or 'tcp', got {t.control!r}")
    if t.bind_host in ("0.0.0.0", "::", "") and not t.advertise_host:
        raise ValueError(
            f"parameter 'transfer.bind_host': {t.bind_host!r} is a wildcard: set transfer.advertise_host "
            "to the address peers should connect to"
        )
    if t.control == "tcp" and t.require_path != "tcp":
        raise ValueError(
            "parameter 'transfer.control': tcp needs transfer.require_path=tcp: across hosts only a path "
            "where D writes every byte itself keeps the proofs (docs/protocol.md)"
        )


def _with_rate_floor(settings: EngineSettings, explicit: bool) -> EngineSettings:
    """`batch.rate_floor_tok_s`, unless given (> 0), is the codec's real time over `rate.rtf`."""
    b = settings.batch
    if b.rate_floor_tok_s < 0 or not math.isfinite(b.rate_floor_tok_s):
        raise ValueError(
            f"parameter 'batch.rate_floor_tok_s': must be >= 0 (0: from rate.rtf), got {b.rate_floor_tok_s}"
        )
    rtf = settings.rate.rtf
    if not (math.isfinite(rtf) and rtf > 0):
        raise ValueError(f"parameter 'rate.rtf': must be a positive number, got {rtf}")
    if explicit and b.rate_floor_tok_s > 0:
        return settings
    floor = codec_spec(settings).rows_per_second / rtf
    return dataclasses.replace(settings, batch=dataclasses.replace(b, rate_floor_tok_s=floor))


def triton_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """Flatten Triton's `{"key": {"string_value": "v"}}` parameters; keys starting with `tandem.` are ours."""
    out: dict[str, str] = {}
    for key, value in (model_config.get("parameters") or {}).items():
        if key.startswith("tandem."):
            out[key[len("tandem.") :]] = str(value.get("string_value", ""))
    return out
