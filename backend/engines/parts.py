"""What every engine builds the same way from its settings: decoder, pool, batch, intake, transfer path.

One builder keeps the engines from drifting apart: equal settings must mean equal behaviour, or
`tts` and `tts_mono` stop producing identical tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from tandem.backend.codec.base import Codec
from tandem.backend.codec.builder import build_codec, codec_spec, framing
from tandem.backend.codec.chunking import ChunkPolicy
from tandem.backend.engines.batch import DecodeBatch
from tandem.backend.kv.pool import KVPool
from tandem.backend.metrics import MetricsSink
from tandem.backend.model.checkpoint import load_checkpoint
from tandem.backend.model.config import preset
from tandem.backend.model.csm_checkpoint import CsmModel, is_csm, load_csm
from tandem.backend.model.decoder import Decoder
from tandem.backend.model.fp8 import require_fp8_device
from tandem.backend.model.row_step import CsmRowStep, RowStep
from tandem.backend.scheduling.intake import Intake, _HasSink
from tandem.backend.settings import MAX_BATCH, EngineSettings
from tandem.transfer import PathOptions, TransferError, TransferPath, WireLayout, build_path
from tandem.transfer.auth import read_secret, unit_secret
from tandem.transfer.control import control_dir

R = TypeVar("R", bound=_HasSink)
log = logging.getLogger("tandem")


def size_from_device(settings: EngineSettings, decoder: Decoder) -> EngineSettings:
    """Settings with the pool and the batch bound sized for this engine's device, once, after its
    weights are loaded: `pool.memory_fraction` > 0 turns into `num_pages` (that share of the
    device's total memory, in pages of this decoder's KV; refused with the figures where the device
    has not that much free, or is not a GPU), and `batch.max_batch` 0 into the pool's page count
    capped at MAX_BATCH (every stream holds a page at least; admission's page reservation and the
    rate floor decide how many really run)."""
    p, b = settings.pool, settings.batch
    pages = p.num_pages
    if p.memory_fraction > 0:
        device = decoder.device
        if device.type != "cuda":
            raise ValueError(
                f"parameter 'pool.memory_fraction': sizes a GPU's pool; this engine runs on {device}"
            )
        free, total = torch.cuda.mem_get_info(device)
        page_bytes = decoder.kv_layout().token_bytes * p.page_size
        want = int(p.memory_fraction * total)
        if want > free:
            raise ValueError(
                f"parameter 'pool.memory_fraction': {p.memory_fraction:g} of {total / 2**30:.1f} GiB is "
                f"{want / 2**30:.1f} GiB, but {free / 2**30:.1f} GiB are free on {device}"
            )
        pages = want // page_bytes
        log.info("pool: %d pages of %d tokens (%.1f GiB of %s)", pages, p.page_size, want / 2**30, device)
    max_batch = b.max_batch or min(MAX_BATCH, pages)
    return dataclasses.replace(
        settings,
        pool=dataclasses.replace(p, num_pages=pages, memory_fraction=0.0),
        batch=dataclasses.replace(b, max_batch=max_batch),
    )


def make_pool(decoder: Decoder, settings: EngineSettings, storage: torch.Tensor | None = None) -> KVPool:
    """The engine's pool; `storage` (D in direct mode) is the transfer receiver's arena viewed as one."""
    p = settings.pool
    return KVPool(decoder.kv_layout(), p.num_pages, p.page_size, decoder.device, storage)


def chunk_policy(settings: EngineSettings) -> ChunkPolicy:
    """D's and `tts_mono`'s chunk sizes (and the windows the vocoder warms): the batch settings on the
    codec's framing and real-time clock."""
    b = settings.batch
    return ChunkPolicy(
        b.first_chunk_rows,
        b.chunk_growth,
        b.max_chunk_rows,
        framing(settings),
        lead_fraction=b.chunk_lead_fraction,
        min_rows=b.min_chunk_rows,
        rows_per_second=codec_spec(settings).rows_per_second,
    )


def make_codec(settings: EngineSettings, device: torch.device) -> Codec:
    """The vocoder's (or the monolithic engine's) codec, warmed so no stream pays a shape's first
    call: on a GPU every window length up to the longest this chunk policy cuts (final chunks'
    included); on a CPU, where a first call costs little more than the next, the first chunk's."""
    codec = build_codec(settings, device)
    warm = getattr(codec, "warm", None)
    if warm is not None:
        spec = codec_spec(settings)
        lengths = chunk_policy(settings).window_frames(spec.rows_per_frame)
        gpu = device.type == "cuda" and lengths
        lengths = list(range(1, max(lengths) + 1)) if gpu else lengths[:1]
        t0 = time.perf_counter()
        warm(lengths)
        took = time.perf_counter() - t0
        log.info("codec %s warmed on %d window lengths in %.2f s", spec.kind, len(lengths), took)
    return codec


def make_batch(
    decoder: Decoder,
    pool: KVPool,
    settings: EngineSettings,
    metrics: MetricsSink,
    clock: Callable[[], float] = time.perf_counter,
    row_step: RowStep | None = None,
) -> DecodeBatch:
    """The running batch; `clock` times its chunks (the listener's lead, the rate after the first);
    `row_step` makes its rows (None: a plain decoder's head and sampler)."""
    b = settings.batch
    decoder.paged_attention = b.paged_attention
    return DecodeBatch(
        decoder,
        pool,
        chunk_policy(settings),
        metrics,
        b.rate_floor_tok_s,
        cuda_graphs=b.cuda_graphs,
        max_batch=b.max_batch,
        graph_warmup_context=b.graph_warmup_context,
        clock=clock,
        row_step=row_step,
    )


def make_intake(settings: EngineSettings, _kind: type[R]) -> Intake[R]:
    """A bounded intake for requests of type `_kind` (the argument only fixes the type)."""
    return Intake(settings.batch.max_queue, settings.batch.admission_timeout_s)


def transfer_path(settings: EngineSettings, layout: WireLayout | None = None) -> TransferPath:
    """Probe the configured paths in order; with `require_path` set, that one or a start-up error.
    (The settings' cross-field rules were checked when they were parsed, `backend/settings.py`.)"""
    t = settings.transfer
    names = [p.strip() for p in t.paths.split(",") if p.strip()]
    return build_path(names, t.require_path or None, path_options(settings, layout))


def path_options(settings: EngineSettings, layout: WireLayout | None = None) -> PathOptions:
    """What the paths need from this engine: the unit's sidecar and the KV layout it checks on every
    registration (proxy), the addresses and secret file (tcp)."""
    t = settings.transfer
    return PathOptions(
        unit=t.unit,
        layout=layout,
        bind_host=t.bind_host,
        advertise_host=t.advertise_host,
        secret_file=t.secret_file,
    )


def control_secret(settings: EngineSettings) -> bytes | None:
    """The unit secret for a tcp control plane (None with the unit socket): `secret_file`, else the
    unit's control directory's (created if missing; only shared by processes of one host)."""
    t = settings.transfer
    if t.control != "tcp":
        return None
    if t.secret_file:
        try:
            return read_secret(Path(t.secret_file))
        except OSError as exc:
            raise TransferError(f"tandem.transfer.secret_file: cannot read {t.secret_file}: {exc}") from None
    return unit_secret(control_dir(t.unit))


def wire_layout(decoder: Decoder) -> WireLayout:
    """The transfer library's view of this decoder's KV (it knows nothing of decoders)."""
    kv = decoder.kv_layout()
    dtype = str(kv.dtype).removeprefix("torch.")
    return WireLayout(kv.num_layers, kv.num_kv_heads, kv.head_dim, dtype, kv.scale_digest)


def build_decoder(settings: EngineSettings, device: torch.device) -> Decoder:
    """The engine's decoder: a real checkpoint directory (config.json + safetensors), else a preset with
    deterministic random weights; the same code path serves CPU and GPU instances. `tandem.model.dtype
    =fp8` / `tandem.kv.dtype=fp8` quantise it after the load (bf16 compute), refused with
    `Fp8Unsupported` before anything loads where the device cannot run FP8."""
    src = settings.model
    fp8_weights, fp8_kv = src.dtype == "fp8", settings.kv.dtype == "fp8"
    for flag, what in ((fp8_weights, "tandem.model.dtype"), (fp8_kv, "tandem.kv.dtype")):
        if flag:
            require_fp8_device(device, what)
    dtype = "bfloat16" if fp8_weights or (fp8_kv and not src.dtype) else src.dtype
    if src.checkpoint:
        decoder = load_checkpoint(src.checkpoint, device=device, dtype=dtype or None)
        log.info("loaded checkpoint %s on %s", src.checkpoint, device)
    else:
        cfg = preset(src.preset)
        if dtype:
            cfg = cfg.with_dtype(dtype)
        decoder = Decoder.random(cfg, device=device, seed=src.seed)
        log.info("built preset %s (random weights, seed %d) on %s", src.preset, src.seed, device)
    if fp8_weights or fp8_kv:
        decoder.quantize_fp8(weights=fp8_weights, kv=fp8_kv)
        log.info("FP8: E4M3 weights %s, E4M3 KV %s", fp8_weights, fp8_kv)
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    return decoder.eval()


def build_csm(settings: EngineSettings, device: torch.device) -> CsmModel | None:
    """The engine's Sesame CSM (backbone + depth decoder) when its checkpoint is one, else None (the
    decoder is then `build_decoder`'s). FP8 is refused for CSM (its depth decoder has no FP8 path)."""
    src = settings.model
    if not src.checkpoint or not is_csm(src.checkpoint):
        return None
    if src.dtype == "fp8" or settings.kv.dtype == "fp8":
        raise ValueError("tandem.model.dtype / tandem.kv.dtype fp8: not available for a CSM checkpoint")
    model = load_csm(src.checkpoint, device=device, dtype=src.dtype or None)
    log.info("loaded CSM checkpoint %s on %s", src.checkpoint, device)
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    model.backbone.eval()
    model.depth.eval()
    return model


def csm_row_step(model: CsmModel, settings: EngineSettings) -> CsmRowStep:
    """CSM's row step, its depth pool seated for the larger of a decode step and a prefill forward
    (the settings already sized, `size_from_device`)."""
    b = settings.batch
    return CsmRowStep(model, max(b.max_batch, b.prefill_batch_max))
