"""The pieces every engine builds the same way from its settings.

The monolithic engine, P and D each own a KV pool, most own a decode batch and a bounded intake, and P
and D select a transfer path; building them here keeps the three engines from drifting apart (equal
settings must mean equal behaviour, or `tts` and `tts_mono` stop producing identical tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from tandem.backend.codec.builder import framing
from tandem.backend.codec.reference import ChunkPolicy
from tandem.backend.engines.batch import DecodeBatch
from tandem.backend.kv.pool import KVPool
from tandem.backend.metrics import MetricsSink
from tandem.backend.model.decoder import Decoder
from tandem.backend.scheduling.intake import Intake, _HasSink
from tandem.backend.settings import EngineSettings
from tandem.transfer import PATHS, TransferError, TransferPath, WireLayout, select_path
from tandem.transfer.auth import read_secret, unit_secret
from tandem.transfer.control import control_dir
from tandem.transfer.proxy_path import ProxyPath
from tandem.transfer.tcp_path import TcpPath

R = TypeVar("R", bound=_HasSink)


def make_pool(decoder: Decoder, settings: EngineSettings, storage: torch.Tensor | None = None) -> KVPool:
    """The engine's pool; `storage` (D in direct mode) is the transfer receiver's arena viewed as one."""
    p = settings.pool
    return KVPool(decoder.kv_layout(), p.num_pages, p.page_size, decoder.device, storage)


def chunk_policy(settings: EngineSettings) -> ChunkPolicy:
    b = settings.batch
    return ChunkPolicy(b.first_chunk_rows, b.chunk_growth, b.max_chunk_rows, framing(settings))


def make_batch(decoder: Decoder, pool: KVPool, settings: EngineSettings, metrics: MetricsSink) -> DecodeBatch:
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
    )


def make_intake(settings: EngineSettings, _kind: type[R]) -> Intake[R]:
    """A bounded intake for requests of type `_kind` (the argument only fixes the type)."""
    return Intake(settings.batch.max_queue, settings.batch.admission_timeout_s)


def transfer_path(settings: EngineSettings, layout: WireLayout | None = None) -> TransferPath:
    """Probe the configured paths in order; with `require_path` set, that one or a start-up error.
    The tcp path gets this unit's bind/advertise addresses and secret file; the proxy path this unit's
    sidecar (`tandem.transfer.unit`, the name `tandem-proxy --unit` serves) and the KV layout, which
    the sidecar checks on every registration."""
    t = settings.transfer
    if t.control not in ("unix", "tcp"):
        raise TransferError(f"tandem.transfer.control must be 'unix' or 'tcp', got {t.control!r}")
    if t.bind_host in ("0.0.0.0", "::", "") and not t.advertise_host:
        raise TransferError(
            f"tandem.transfer.bind_host={t.bind_host!r} is a wildcard: set tandem.transfer.advertise_host "
            "to the address peers should connect to"
        )
    if t.control == "tcp" and t.require_path != "tcp":
        raise TransferError(
            "tandem.transfer.control=tcp needs tandem.transfer.require_path=tcp: across hosts only a path "
            "where D writes every byte itself keeps the proofs (docs/protocol.md)"
        )
    registry = path_registry(settings, layout)
    names = [p.strip() for p in t.paths.split(",") if p.strip()]
    return select_path(names, t.require_path or None, registry)


def path_registry(
    settings: EngineSettings, layout: WireLayout | None = None
) -> dict[str, Callable[[], TransferPath]]:
    """The path factories `transfer_path` chooses from: the library's, with the tcp and proxy paths
    bound to this engine's settings (addresses and secret; unit and KV layout)."""
    t = settings.transfer
    registry = {
        **PATHS,
        "tcp": lambda: TcpPath(
            bind_host=t.bind_host,
            advertise_host=t.advertise_host or None,
            secret_file=t.secret_file or None,
        ),
    }
    if ProxyPath.name in PATHS:
        registry[ProxyPath.name] = lambda: ProxyPath(unit=t.unit, layout=layout)
    return registry


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
    return WireLayout(kv.num_layers, kv.num_kv_heads, kv.head_dim, str(kv.dtype).removeprefix("torch."))
